"""TRL's `AsyncGRPOTrainer` on CPU fed by rollbuf, for tests/integration/test_trl.py: a tiny Llama built from a
config (no download), a word-level tokenizer built locally, rollbuf's worker, weight sync and checkpoint callback,
and the CPU test doubles of tests/trl_doubles.py.

    python -m tests.trl_trainer URL OUTDIR MAX_STEPS [--resume]

Writes OUTDIR/result.json at the end: whether the parameters changed, the losses, the commits sent, and the rollbuf
step of every sample the trainer took, in order.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from tests import trl_doubles
from trainer_client import TrainerClient
from trainer_client.async_grpo import RollbufCheckpoints, RollbufWeightSync, align
from trainer_client.rollout_samples import GROUP_ID_STRIDE
from trainer_client.trl_worker import RollbufRolloutWorker

VOCAB = 64
BATCH_SIZE = 8
REGISTRATION: dict[str, Any] = {
    "batch_size": BATCH_SIZE,
    "max_token_len": 32,
    "acknowledge": "commit",
    "starting_step": 0,
    "max_staleness": 16,
}


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_llama(path: Path) -> str:
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
        LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


class ConsumedSteps(queue.Queue[Any]):
    """The worker's buffer, noting which rollbuf steps' samples the trainer took (by the group id's step)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.taken: list[int] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        sample = super().get(block, timeout)
        self.taken.append(sample.group_id // GROUP_ID_STRIDE)
        return sample


class Losses(TrainerCallback):
    """The loss TRL logs at each optimizer step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    trl_doubles.install()
    rb = TrainerClient(args.url)
    rb.register(**REGISTRATION)
    config = AsyncGRPOConfig(
        output_dir=str(args.out / "run"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        token_budget=0,
        weight_sync_steps=1,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        learning_rate=1e-2,
        dtype="float32",
        heartbeat_stale_after_s=120.0,
        seed=0,
    )
    align(
        config,
        batch_size=BATCH_SIZE,
        max_staleness=REGISTRATION["max_staleness"],
        read_ahead_bound=rb.info().max_read_ahead_batches,
    )
    worker = RollbufRolloutWorker(rb, wait=2.0)
    buffer = ConsumedSteps(BATCH_SIZE * 2)
    worker.rollout_buffer = buffer
    checkpoints = RollbufCheckpoints(worker, rb, starting_step=REGISTRATION["starting_step"])
    log = Losses()
    weights = RollbufWeightSync()
    trainer = AsyncGRPOTrainer(
        model=tiny_llama(args.out / "model"),
        args=config,
        processing_class=tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * BATCH_SIZE}),
        callbacks=[checkpoints, log],
        rollout_worker=worker,
        weight_transfer=weights,
    )
    model = trainer.model
    assert model is not None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    checkpoint = None
    if args.resume:
        saved = sorted((args.out / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        checkpoint = str(saved[-1]) if saved else None
    trainer.train(resume_from_checkpoint=checkpoint)
    changed = any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    result = {
        "changed": changed,
        "losses": log.losses,
        "committed": checkpoints.committed,
        "taken": buffer.taken,
        "finite": all(math.isfinite(v) for v in log.losses.values()),
        "resumed_from": checkpoint,
        "global_step": trainer.state.global_step,
        "syncs": weights.syncs,
        "start_step": worker.first_step_read,
    }
    (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
