"""`rollbuf demo --learn`: a tiny torch policy learns a toy task through the real service, on a CPU, with
no downloads. `model` (the policy and its tokenizer), `task` (the environment), `policy` (sampling with
logprobs, batched across concurrent rollouts), `grpo` (the update), `loop` (the run: service, runner,
trainer, weight sync)."""
