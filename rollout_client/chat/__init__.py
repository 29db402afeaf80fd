"""Chat on token ids, for tool-using (agentic) environments: `ChatSession` and `ChatEnvironment`
(docs/agentic.md).

`session` renders messages with the model's chat template and trains on the ids the policy sampled, `tools`
makes a tool's schema from its signature and calls it, `tool_calls` reads the calls in a model's text, and
`examples` is a chat environment on a tokenizer built locally, for the demo and the tests. The names of
`session` are exported here too: `from rollout_client.chat import ChatSession` is the short path.
"""

from rollout_client.chat.session import (
    ROLES,
    AssistantTurn,
    ChatEnvironment,
    ChatSession,
    ChatTemplateError,
    ChatTokenizer,
    Message,
    pretrained_tokenizer,
)

__all__ = [
    "ROLES",
    "AssistantTurn",
    "ChatEnvironment",
    "ChatSession",
    "ChatTemplateError",
    "ChatTokenizer",
    "Message",
    "pretrained_tokenizer",
]
