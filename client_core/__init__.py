"""What both clients share: one error tree (`errors`), one retry policy (`retry`), one set of defaults
(`config`). `trainer_client` and `rollout_client` import it; it imports neither them nor the service, and
it needs only httpx and tenacity. Only the send path is written twice, once blocking and once async, in
each client, as in httpx."""
