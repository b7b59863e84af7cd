"""`python -m tokenspeed.models.embedded.training.run` (or `scripts/train_embedded.py`): train the embedded models.

One command trains, in this order, `embedded` (Qwen3 dense), its EAGLE draft
head (on the frozen, trained model's hidden states), and `embedded-moe`
(DeepSeek-V3 shape) jointly with its MTP layer, on the corpus of `corpus.py`,
then writes for each a Hugging Face checkpoint folder, the files to commit
under `package/`, a JSON-lines loss log per phase and `train_embedded.json`
(command, device, date, data hash, metrics).

Time: `--time-budget` seconds cover the whole command from the end of its
imports (a few seconds: torch). Reading and
tokenising the corpus comes first; the rest is split over the three phases in
the ratio of `PHASE_SHARES`, each phase keeping a reserve for its evaluation
and export, and each sizes its step count from its measured throughput
(`loop.py`). `--steps-*` fix the step counts instead (deterministic). The
shapes are the package's `config.json` files, so the weights fit the configs
that ship; `--smoke` shrinks everything to run on a CPU in seconds.

Why these sizes: a ~4M-parameter model costs ~3e7 FLOP per trained token
(6 x parameters, plus the 4096-wide head and 1024-token attention), so an
H200 can push 1-5M tokens/s through it and a 3-minute phase sees a few
hundred million tokens: several epochs of the ~35M-token corpus (stdlib plus
capped installed packages; the stdlib alone is too small). Batches are
128 x 1024 tokens: wide enough to keep the GPU busy, narrow enough for a few
thousand optimizer steps. The log's `sized` line and `tokens_per_s` show what
the machine actually did.

`--models eagle` (without `embedded`) trains only the EAGLE head, on the
shipped `embedded` weights (`load_shipped_dense`: the package's bf16 file,
frozen; it is read, never written), with the whole `--time-budget` for that
phase. Its `package/` holds the head's `eagle/` files and
`benchmarks/results/h200/train_embedded.json`: the committed record
(`--base-record`) with the head's entry and phase replaced and the head's own
command, device and date under `metrics.embedded.eagle.run`
(`merge_eagle_record`); the base models' metrics stay as they were.

Every metric is computed from the exported weights (rounded to bf16, as
shipped), in fp32, on `--eval-windows` held-out windows of `--seq-len` tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.models.embedded.materialize import (
    EAGLE_DIR,
    WEIGHTS_FILE,
    package_config,
    package_dir,
    trained_weights_file,
    write_model_folder,
    write_weights,
)
from tokenspeed.models.embedded.training import corpus as corpus_mod
from tokenspeed.models.embedded.training.deepseek_net import DeepseekNet
from tokenspeed.models.embedded.training.eagle import RECIPES, EagleHead, eagle_loss
from tokenspeed.models.embedded.training.loop import JsonLog, PhaseSpec, WindowBatches, run_phase
from tokenspeed.models.embedded.training.metrics import language_model_metrics, next_next_metrics
from tokenspeed.models.embedded.training.qwen3_net import Qwen3Net
from tokenspeed.models.embedded.training.verify import transformers_logit_difference

logger = logging.getLogger("tokenspeed.models")

PHASE_SHARES = {"embedded": 0.42, "eagle": 0.13, "embedded-moe": 0.45}
DEFAULT_EAGLE_RECIPE = "eagle1"
BASE_RECORD = Path("benchmarks/results/h200/train_embedded.json")  # relative to the repository root (the cwd)
EVAL_RESERVE_S = 12.0  # per phase: final evaluation, transformers check and export on the GPU
MTP_LOSS_WEIGHT = 0.3
BIAS_UPDATE_RATE = 1e-3
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "embedded": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16),
    "eagle": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "embedded-moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation, batches and noise")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="torch.compile the training step (auto: on CUDA)")
    p.add_argument("--time-budget", type=float, default=450.0, help="seconds for the whole command (time-budgeted phases)")
    p.add_argument("--models", default="embedded,embedded-moe",
                   help="which models (the EAGLE head comes with embedded); `eagle` alone: only the head, on the shipped "
                        "`embedded` weights")
    p.add_argument("--steps-embedded", type=int, default=None, help="fixed steps instead of the time budget")
    p.add_argument("--steps-eagle", type=int, default=None, help="fixed steps instead of the time budget")
    p.add_argument("--steps-moe", type=int, default=None, help="fixed steps instead of the time budget")
    p.add_argument("--batch-size", type=int, default=128, help="windows per step")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per training and evaluation window")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the main models")
    p.add_argument("--eagle-lr", type=float, default=6e-3,
                   help="peak learning rate of the EAGLE head (issue 14: 6e-3, was 1e-3)")
    p.add_argument("--eagle-recipe", choices=sorted(RECIPES), default=DEFAULT_EAGLE_RECIPE,
                   help="the EAGLE head's loss (training/eagle.py)")
    p.add_argument("--eagle-intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the shipped eagle/config.json's)")
    p.add_argument("--base-record", type=Path, default=BASE_RECORD,
                   help="`--models eagle`: the committed record the head's results are merged into")
    p.add_argument("--eval-windows", type=int, default=512, help="held-out windows scored at the end")
    p.add_argument("--sources", default=",".join(corpus_mod.SOURCES), help="corpus sources")
    p.add_argument("--site-budget-mb", type=float, default=96.0, help="bytes of installed packages' sources")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, corpus and step counts: seconds on a CPU")
    p.add_argument("--no-verify", action="store_true", help="skip the transformers logit check of the exports")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - {"embedded", "eagle", "embedded-moe"})
    if unknown:
        p.error(f"unknown models {unknown}")
    if args.smoke:
        defaults = dict(steps_embedded=8, steps_eagle=4, steps_moe=8, sources="stdlib")
        for key, value in defaults.items():
            if getattr(args, key) in (None, p.get_default(key)):
                setattr(args, key, value)
        args.batch_size, args.seq_len, args.eval_windows = min(args.batch_size, 4), min(args.seq_len, 32), min(args.eval_windows, 8)
    return args


def load_shipped_dense(device: torch.device) -> Qwen3Net:
    """The shipped `embedded` model (the package's config and bf16 weights, held in fp32), frozen."""
    from safetensors.torch import load_file

    path = trained_weights_file("embedded")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no shipped weights of `embedded` to train a draft head on")
    net = Qwen3Net(package_config("embedded"))
    net.load_hf_state_dict(load_file(str(path)))
    net.requires_grad_(False)
    return net.to(device)


class TimeBudget:
    """Splits what is left of the command's seconds over the phases still to run."""

    def __init__(self, seconds: float, shares: dict[str, float]) -> None:
        self.deadline = time.perf_counter() + seconds
        self.pending = dict(shares)

    def take(self, phase: str) -> float:
        share = self.pending.pop(phase)
        left = self.deadline - time.perf_counter() - EVAL_RESERVE_S * (len(self.pending) + 1)
        return max(10.0, left * share / (share + sum(self.pending.values())))


def _config(name: str, smoke: bool) -> dict[str, Any]:
    config = package_config("embedded" if name == "eagle" else name, draft=name == "eagle")
    return {**config, **SMOKE_SHAPES[name]} if smoke else config


def _round_to_bf16(module: nn.Module) -> None:
    """The shipped weights are bf16: evaluate exactly those (the routing bias stays fp32, as stored)."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(param.to(torch.bfloat16).to(param.dtype))


def _count(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                                   "cpu" if args.device == "auto" else args.device)
        self.compile = args.compile == "on" or (args.compile == "auto" and self.device.type == "cuda")
        self.budget = TimeBudget(args.time_budget, {k: v for k, v in PHASE_SHARES.items() if self._wanted(k)})
        self.out: Path = args.out
        self.record: dict[str, Any] = {"metrics": {}, "phases": {}}

    def _autocast(self) -> torch.autocast:
        """bf16 autocast on the GPU (a fresh context each call: torch.compile traces it), fp32 on the CPU."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def _wanted(self, phase: str) -> bool:
        models = self.args.models.split(",")
        return (phase == "eagle" and "embedded" in models) or phase in models

    @property
    def eagle_only(self) -> bool:
        """`--models eagle` without `embedded`: the head is trained on the shipped, frozen `embedded` weights."""
        models = self.args.models.split(",")
        return "eagle" in models and "embedded" not in models

    def _spec(self, name: str, steps: int | None, lr: float) -> PhaseSpec:
        a = self.args
        seconds = None if steps is not None else self.budget.take(name)
        if steps is not None:
            self.budget.pending.pop(name, None)
        return PhaseSpec(name=name, peak_lr=lr, warmup_steps=max(2, steps // 10) if steps else 100,
                         batch_size=a.batch_size, seq_len=a.seq_len, steps=steps, seconds=seconds,
                         log_every=2 if a.smoke else 25, eval_every=5 if a.smoke else 250)

    def _eval_fn(self, hidden_fn: Callable[[torch.Tensor], torch.Tensor], head: Callable[[], torch.Tensor]) -> Callable[[], dict[str, float]]:
        subset = self.windows[:: max(1, len(self.windows) // 16)][:16]

        def evaluate() -> dict[str, float]:
            metrics = language_model_metrics(hidden_fn, head(), subset, self.corpus.token_bytes)
            return {"heldout_bits_per_byte": metrics["bits_per_byte"], "heldout_top1": metrics["top1"]}

        return evaluate

    def load_corpus(self) -> None:
        a = self.args
        options = corpus_mod.CorpusOptions(
            sources=tuple(a.sources.split(",")),
            site_budget_bytes=int(a.site_budget_mb * 1e6),
            held_out_per_mille=200 if a.smoke else 20,
            total_budget_bytes=400_000 if a.smoke else None,
        )
        start = time.perf_counter()
        self.corpus = corpus_mod.build_corpus(package_dir() / "tokenizer.json", options)
        self.windows = corpus_mod.eval_windows(self.corpus.held_out, a.seq_len, a.eval_windows)
        self.train_stream = torch.from_numpy(self.corpus.train).to(self.device)
        summary = self.corpus.summary()
        summary["seconds"] = round(time.perf_counter() - start, 2)
        summary["eval_windows"], summary["eval_window_tokens"] = len(self.windows), a.seq_len
        self.record["data_files_sha256"] = summary.pop("data_files_sha256")
        self.record["corpus"] = summary
        print(json.dumps({"corpus": summary}), flush=True)

    def _phase(self, name: str, spec: PhaseSpec, params: list[nn.Parameter], step_fn: Callable[..., Any],
               batch_length: int, **kw: Any) -> dict[str, Any]:
        a = self.args
        log = JsonLog(self.out / "logs" / f"{name}.jsonl")
        batches = WindowBatches(self.train_stream, batch_length, a.batch_size, a.seed)
        try:
            compiled = torch.compile(step_fn) if self.compile else None
            result = run_phase(spec, params, compiled or step_fn, batches, log, device=self.device,
                               tokens_per_batch=a.batch_size * a.seq_len, eager_step_fn=step_fn if compiled else None,
                               **kw)
        finally:
            log.close()
        self.record["phases"][name] = result
        return result

    def train_dense(self) -> Qwen3Net:
        a = self.args
        config = _config("embedded", a.smoke)
        net = Qwen3Net(config).to(self.device)

        def step(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            with self._autocast():
                logits = F.linear(net(batch[:, :-1]), net.head_weight)
            return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()), {}

        spec = self._spec("embedded", a.steps_embedded, a.lr)
        result = self._phase("embedded", spec, list(net.parameters()), step, a.seq_len + 1,
                             eval_fn=self._eval_fn(net, lambda: net.head_weight))
        _round_to_bf16(net)
        metrics = language_model_metrics(net, net.head_weight, self.windows, self.corpus.token_bytes)
        tensors = net.hf_state_dict()
        folder = self.out / "embedded"
        write_model_folder(folder, config, tensors)
        self._record_model("embedded", folder, net, tensors, result, metrics)
        return net

    def train_eagle(self, target: Qwen3Net) -> None:
        a = self.args
        config = _config("eagle", a.smoke and not self.eagle_only)  # the shipped target has the shipped width
        if a.eagle_intermediate_size is not None:
            config = {**config, "intermediate_size": a.eagle_intermediate_size}
        recipe = RECIPES[a.eagle_recipe]
        head = EagleHead(config).to(self.device)
        target.requires_grad_(False)
        embed, lm_head = target.model.embed_tokens.weight, target.head_weight

        def step(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            with self._autocast():
                with torch.no_grad():
                    hidden = target(batch)
                return eagle_loss(head, hidden, batch, embed, lm_head, recipe=recipe)

        spec = self._spec("eagle", a.steps_eagle, a.eagle_lr)
        result = self._phase("eagle", spec, list(head.parameters()), step, a.seq_len)
        _round_to_bf16(head)
        metrics = next_next_metrics(target, lambda h, ids: head(F.embedding(ids, embed), h), lm_head, self.windows)
        tensors = head.hf_state_dict()
        (self.out / "embedded" / EAGLE_DIR).mkdir(parents=True, exist_ok=True)
        (self.out / "embedded" / EAGLE_DIR / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_weights(self.out / "embedded" / EAGLE_DIR / WEIGHTS_FILE, tensors)
        self._package(f"{EAGLE_DIR}/{WEIGHTS_FILE}", tensors, config=config)
        entry: dict[str, Any] = {
            "params": _count(tensors), "training_tokens": result["tokens"], "wall_time_s": result["seconds"],
            "next_next_top1": metrics["top1"], "next_next_agreement": metrics["agreement"],
            "intermediate_size": config["intermediate_size"], "recipe": {"name": a.eagle_recipe, **recipe.to_dict()},
        }
        if self.eagle_only:  # the target's own score on these windows: proof that the shipped weights were read
            entry["target_heldout_top1"] = language_model_metrics(target, lm_head, self.windows,
                                                                  self.corpus.token_bytes)["top1"]
        self.record["metrics"].setdefault("embedded", {})["eagle"] = entry

    def train_moe(self) -> None:
        a = self.args
        config = _config("embedded-moe", a.smoke)
        net = DeepseekNet(config).to(self.device)

        def step(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            ids, targets = batch[:, :-1], batch[:, 1:]
            with self._autocast():
                hidden, loads = net.forward_with_loads(ids)
                main = F.cross_entropy(F.linear(hidden, net.head_weight).float().flatten(0, 1), targets.flatten())
                mtp_hidden, mtp_loads = net.mtp(hidden[:, :-1], ids[:, 1:])
                mtp_logits = F.linear(mtp_hidden, net.head_weight).float()
                mtp = F.cross_entropy(mtp_logits.flatten(0, 1), targets[:, 1:].flatten())
            return main + MTP_LOSS_WEIGHT * mtp, {"main_loss": main.detach(), "mtp_loss": mtp.detach(),
                                                  "loads": torch.stack(loads + mtp_loads)}

        last_loads: list[torch.Tensor] = []

        def balance(metrics: dict[str, torch.Tensor]) -> None:
            net.balance_experts(metrics["loads"], BIAS_UPDATE_RATE)
            last_loads[:] = [metrics["loads"]]

        spec = self._spec("embedded-moe", a.steps_moe, a.lr)
        result = self._phase("embedded-moe", spec, list(net.parameters()), step, a.seq_len + 1,
                             eval_fn=self._eval_fn(net, lambda: net.head_weight), after_step=balance)
        _round_to_bf16(net)
        metrics = language_model_metrics(net, net.head_weight, self.windows, self.corpus.token_bytes)
        mtp = next_next_metrics(net, lambda h, ids: net.mtp(h, ids)[0], net.head_weight, self.windows)
        folder = self.out / "embedded-moe"
        write_model_folder(folder, config, net.hf_state_dict())
        compact = net.hf_state_dict(compact=True)
        self._record_model("embedded-moe", folder, net, compact, result, metrics, package_file=f"moe/{WEIGHTS_FILE}")
        loads = last_loads[0].float()
        self.record["metrics"]["embedded-moe"]["mtp"] = {"next_next_top1": mtp["top1"], "next_next_agreement": mtp["agreement"]}
        self.record["metrics"]["embedded-moe"]["expert_load_max_over_mean"] = [
            round(float(row.max() / row.mean()), 3) for row in loads
        ]

    def _package(self, relpath: str, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> None:
        """The files to commit, at their repository paths (not for smoke shapes: they would not fit the configs).

        `config`: written beside the weights (the draft head's, whose width `--eagle-intermediate-size` may change).
        """
        if not self.args.smoke:
            target = self.out / "package" / "tokenspeed" / "models" / "embedded" / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            write_weights(target, tensors)
            if config is not None:
                (target.parent / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def _record_model(self, name: str, folder: Path, net: nn.Module, tensors: dict[str, torch.Tensor],
                      result: dict[str, Any], metrics: dict[str, float], package_file: str = WEIGHTS_FILE) -> None:
        self._package(package_file, tensors)
        entry: dict[str, Any] = {
            "params": _count(tensors), "training_tokens": result["tokens"], "wall_time_s": result["seconds"],
            "heldout_bits_per_byte": metrics["bits_per_byte"], "heldout_top1": metrics["top1"],
            "heldout_nats_per_token": metrics["nats_per_token"], "heldout_tokens": metrics["tokens"],
        }
        if not self.args.no_verify:
            try:
                entry["transformers_max_logit_diff"] = transformers_logit_difference(folder, net, self.windows[:2])
            except Exception as error:  # a check must not cost the trained weights: record why it failed
                logger.exception("transformers could not check %s", folder)
                entry["transformers_max_logit_diff"] = f"check failed: {error!r}"[:300]
        self.record["metrics"][name] = entry

    def save_record(self) -> None:
        """Written after every phase, so a later failure keeps what was trained."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "train_embedded.json").write_text(json.dumps(self.record, indent=2) + "\n")

    def package_merged_record(self) -> None:
        """`--models eagle`: the committed record with this run's head merged in, at its repository path."""
        base = self.args.base_record
        if self.args.smoke or not base.is_file():
            logger.warning("no merged record written (%s)", "smoke run" if self.args.smoke else f"{base} absent")
            return
        merged = merge_eagle_record(json.loads(base.read_text()), self.record)
        target = self.out / "package" / base
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(merged, indent=2) + "\n")


RUN_KEYS = ("command", "device", "date", "versions", "seed", "compile", "data_files_sha256")


def merge_eagle_record(base: dict[str, Any], eagle_run: dict[str, Any]) -> dict[str, Any]:
    """`base` (a full run's record) with the EAGLE head of `eagle_run` (a `--models eagle` run's) in its place.

    The base models' metrics, phases and top-level command stay as they were; the head's entry
    (`metrics.embedded.eagle`) and phase (`phases.eagle`) are replaced, and the entry carries its
    own run (`run`: command, device, date, versions, seed, wall time, data hash and corpus of the
    head's run; `same_data_as_base` compares the data hashes).
    """
    merged = json.loads(json.dumps(base))
    entry = dict(eagle_run["metrics"]["embedded"]["eagle"])
    entry["run"] = {k: eagle_run[k] for k in RUN_KEYS if k in eagle_run} | {
        "total_wall_time_s": eagle_run["metrics"].get("total_wall_time_s"), "corpus": eagle_run.get("corpus")}
    entry["run"]["same_data_as_base"] = eagle_run.get("data_files_sha256") == base.get("data_files_sha256")
    merged["metrics"]["embedded"]["eagle"] = entry
    merged["phases"]["eagle"] = eagle_run["phases"]["eagle"]
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # tokenise the corpus on every core
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    trainer = Trainer(args)
    trainer.record.update({
        "command": shlex.join(["python3", *sys.argv]) if argv is None else shlex.join(["train_embedded", *argv]),
        "device": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "seed": args.seed,
        "compile": trainer.compile,
    })
    trainer.load_corpus()
    if trainer._wanted("embedded"):
        dense = trainer.train_dense()
        trainer.save_record()
        trainer.train_eagle(dense)
        trainer.save_record()
    elif trainer.eagle_only:
        trainer.train_eagle(load_shipped_dense(trainer.device))
        trainer.record["metrics"]["total_wall_time_s"] = round(time.perf_counter() - start, 1)
        trainer.save_record()
        trainer.package_merged_record()
    if trainer._wanted("embedded-moe"):
        trainer.train_moe()
    trainer.record["metrics"]["total_wall_time_s"] = round(time.perf_counter() - start, 1)
    trainer.save_record()
    print(json.dumps({"metrics": trainer.record["metrics"]}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
