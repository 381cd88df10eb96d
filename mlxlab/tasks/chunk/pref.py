"""Preference training on the chunk task: DPO or ORPO on top of a chunk SFT run's adapter
(`train +exp=chunk_dpo`, `train +exp=chunk_orpo`, or `train task=chunk_pref objective=...`).

The pairs come from the SFT run's own training split (mlxlab/data/chunk.py `training_windows`,
the windows it trained on). For `examples` of them, most with two or more gold chunks, the SFT
adapter writes an answer by sampling; each answer that is wrong (its chunks are not the gold's,
or it does not score 100) becomes a pair with the gold answer as chosen and it as rejected, and
each picked multi-chunk example also pairs its gold with the gold's one boundary moved by one
message. The run starts from the SFT adapter (lora.init; for DPO it is also the reference), is
evaluated as the SFT run was, and the report sets SFT alone (the SFT run's own evaluation, when
its settings are these) against SFT + preference.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path

from mlxlab.config import DataConfig, TrainConfig, to_dict
from mlxlab.errors import UserError
from mlxlab.tasks.chunk.config import ChunkDataConfig, ChunkPrefConfig
from mlxlab.tasks.chunk.task import ChunkTask, fmt_minutes
from mlxlab.train.job import Run

log = logging.getLogger(__name__)

SFT_RUNS = Path("outputs", "chunk_seg4")
"""Where the newest finished chunk SFT run is looked for when `task.sft` is unset."""
COPIED = ("train.cases.json", "valid.cases.json", "test.cases.json", "build.json")


def find_sft_run(root: Path = SFT_RUNS) -> Path:
    """The newest run directory under `root` with a final adapter, its data and an evaluation."""
    runs = sorted(
        (
            p
            for p in Path(root).glob("*")
            if (p / "adapter").is_dir()
            and (p / "data" / "train.cases.json").is_file()
            and (p / "summary.json").is_file()
        ),
        key=lambda p: p.name,
    )
    if not runs:
        raise UserError(
            f"no finished chunk SFT run under {root}: run `python -m mlxlab train "
            "+exp=chunk_seg4` first, or pass task.sft=<its run directory>"
        )
    return runs[-1].absolute()


def sft_dir(cfg: ChunkPrefConfig) -> Path:
    path = Path(cfg.sft).expanduser().absolute() if cfg.sft else find_sft_run()
    missing = [
        x
        for x in ("adapter", "data/train.cases.json", "data/build.json")
        if not (path / x).exists()
    ]
    if missing:
        raise UserError(
            f"task.sft={path} is not a finished chunk-task run (no {', '.join(missing)}); pass "
            "the run directory `train +exp=chunk_seg4` printed the adapter of"
        )
    return path


def _data_config(build: dict):
    from mlxlab.schema import from_dict

    names = {f.name for f in dataclasses.fields(ChunkDataConfig)}
    return from_dict(ChunkDataConfig, {k: v for k, v in build.items() if k in names})


def pick(windows: list, n: int, multi_share: float, rng: random.Random) -> list:
    """`n` of the (case, messages, gold) windows: round(n * multi_share) with two or more gold
    chunks (fewer if there are fewer), the rest with one, each group in a seeded order."""
    multi = [w for w in windows if len(w[2]) >= 2]
    single = [w for w in windows if len(w[2]) < 2]
    rng.shuffle(multi)
    rng.shuffle(single)
    k = min(len(multi), round(n * multi_share))
    return multi[:k] + single[: n - k]


def is_right(text: str, uuids: list[str], gold: list[dict], conversation_uuid) -> bool:
    """An answer is right when both scorers give it full marks and its chunks are the gold's."""
    from mlxlab.eval.chunk import score_case

    s = score_case(text, uuids, gold, conversation_uuid)
    return (
        s.ref == 100.0 and s.wellformed == 100.0 and s.exact_match == 1.0 and s.boundary_f1 == 1.0
    )


def build_pairs(model, tokenizer, sft_data: Path, cfg: ChunkPrefConfig, batch_size: int = 8):
    """(pair records, stats): the SFT model's sampled wrong answers and the moved-boundary golds
    against the gold answers, over windows of the SFT run's training split."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.data import chunk as data
    from mlxlab.eval.chunk import generate_all

    dcfg = _data_config(json.loads((sft_data / "build.json").read_text()))
    cases = json.loads((sft_data / "train.cases.json").read_text())
    windows = [(c, msgs, gold) for c in cases for msgs, gold in data.training_windows(c, dcfg)]
    rng = random.Random(cfg.seed)
    picked = pick(windows, cfg.examples, cfg.multi_share, rng)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": data.prompt(c, msgs)}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for c, msgs, _ in picked
    ]
    t0 = time.perf_counter()
    mx.random.seed(cfg.seed)
    texts = generate_all(
        model,
        tokenizer,
        prompts,
        cfg.eval.max_tokens,
        batch_size,
        lambda done, total: log.info(f"[pairs] {done}/{total} answers sampled"),
        sampler=make_sampler(temp=cfg.temperature),
    )

    pairs, kinds = [], {"sampled": 0, "moved": 0}
    right = 0
    for (case, msgs, gold), text in zip(picked, texts, strict=True):
        uuids = [m["uuid"] for m in msgs]
        user = [{"role": "user", "content": data.prompt(case, msgs)}]
        # as the SFT data writes it
        chosen = data.gold_answer(msgs, gold, dcfg)
        if is_right(text, uuids, gold, data.conversation_uuid(case)):
            right += 1
        elif text.strip():
            pairs.append(
                {"messages": user, "chosen": chosen, "rejected": text.strip(), "kind": "sampled"}
            )
            kinds["sampled"] += 1
        moved = data.moved_boundary(gold, uuids, rng) if cfg.moved else None
        if moved is not None:
            pairs.append(
                {
                    "messages": user,
                    "chosen": chosen,
                    "rejected": data.gold_answer(msgs, moved, dcfg),
                    "kind": "moved",
                }
            )
            kinds["moved"] += 1
    rng.shuffle(pairs)
    stats = {
        "windows": len(windows),
        "examples": len(picked),
        "multi_chunk_examples": sum(len(g) >= 2 for _, _, g in picked),
        "sampled_right": right,
        "pairs": len(pairs),
        **{f"pairs_{k}": v for k, v in kinds.items()},
        "temperature": cfg.temperature,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return pairs, stats


class ChunkPrefTask(ChunkTask):
    """Pairs into <run>/data (the SFT model loaded on its own, then freed), lora.init = the SFT
    adapter, evaluation of SFT alone (reused from its run when the settings match) and of the
    tuned model, the report."""

    def __init__(self, cfg: ChunkPrefConfig, command: str | None = None):
        super().__init__(cfg, command)
        self.sft: Path | None = None
        self.train_cfg: TrainConfig | None = None

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        if cfg.objective == "sft":
            raise UserError(
                "task=chunk_pref trains on preference pairs: set objective=dpo or objective=orpo"
            )
        self.sft = sft_dir(self.cfg)
        if not cfg.lora.init:
            cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, init=str(self.sft)))
        self.train_cfg = cfg
        return cfg

    def config(self) -> dict:
        out = to_dict(self.cfg)
        out["sft"] = str(self.sft) if self.sft else out["sft"]
        return out

    def prepare_data(self, data: DataConfig, run_dir: Path) -> DataConfig:
        from mlxlab.fsutil import atomic_dir, writable_dir

        writable_dir(run_dir)
        if data.train:
            from mlxlab.data.chunk import dataset_dir

            self.check_windows(dataset_dir(data.train))
            return data
        data_dir = run_dir / "data"
        self.check_windows(self.sft / "data")  # its build.json is the one copied below
        data = dataclasses.replace(data, train=str(data_dir))
        reused = self._reuse_sft_eval(run_dir)
        if (data_dir / "train.jsonl").is_file() and reused:
            return data
        import gc

        import mlx.core as mx

        from mlxlab.lora import io as lora_io
        from mlxlab.models.zoo import load

        cfg = self.train_cfg
        model, tokenizer = load(cfg.model, cfg.dtype)
        lora_io.load(model, self.sft)
        if not (data_dir / "train.jsonl").is_file():

            def write(tmp: Path) -> None:
                for name in COPIED:
                    if (self.sft / "data" / name).is_file():
                        shutil.copy(self.sft / "data" / name, tmp / name)
                pairs, stats = build_pairs(
                    model, tokenizer, self.sft / "data", self.cfg, self.cfg.eval.batch_size
                )
                if not pairs:
                    raise UserError(
                        f"the SFT adapter answered all {stats['examples']} picked examples right "
                        "and task.moved is off: no pairs to train on"
                    )
                with (tmp / "train.jsonl").open("w") as f:
                    for p in pairs:
                        f.write(json.dumps({k: v for k, v in p.items() if k != "kind"}) + "\n")
                (tmp / "pairs.json").write_text(
                    json.dumps(
                        {**stats, "sft": str(self.sft), "kinds": [p["kind"] for p in pairs]},
                        indent=1,
                    )
                    + "\n"
                )
                log.info(
                    f"pairs: {stats['pairs']} ({stats['pairs_sampled']} sampled wrong answers, "
                    f"{stats['pairs_moved']} moved boundaries; {stats['sampled_right']} of "
                    f"{stats['examples']} sampled answers right) in {stats['seconds']:.0f} s"
                )

            atomic_dir(data_dir, write)
        if not reused:  # SFT alone, on this run's copy of the data and these settings
            self.evals["sft"] = self.evaluate(Run(cfg, run_dir, data, model, tokenizer), "sft")
        model = tokenizer = None  # freed before training loads its own copy
        gc.collect()
        mx.clear_cache()
        return data

    def _reuse_sft_eval(self, run_dir: Path) -> bool:
        """SFT alone = the SFT run's own tuned evaluation, copied, when it was made with these
        evaluation settings (the data is the same: this run copies it)."""
        import yaml

        if (run_dir / "eval_sft.json").is_file():
            self.evals["sft"] = json.loads((run_dir / "eval_sft.json").read_text())
            return True
        src = self.sft / "eval_tuned.json"
        try:
            saved = yaml.safe_load((self.sft / "config.yaml").read_text())["task"]["eval"]
        except (OSError, KeyError, TypeError, yaml.YAMLError):
            return False
        if self.cfg.eval.constrained and not {"cover", "read_overruled"} <= set(saved):
            # before eval.cover the constrained decode was under a JSON schema; before
            # eval.read_overruled its merge read the windows the grammar overruled
            return False
        # settings added since the SFT run: their defaults; label_model only adds a score (a run
        # without it shows none for SFT alone), so it does not stop the reuse
        saved = {
            **to_dict(type(self.cfg.eval)()),
            **saved,
            "label_model": self.cfg.eval.label_model,
        }
        if not src.is_file() or saved != to_dict(self.cfg.eval):
            return False
        from mlxlab.eval.chunk import PASSES, pass_path
        from mlxlab.fsutil import atomic_write

        for a, b in (  # the summary last: its presence says the copy is complete
            (self.sft / "eval_tuned.jsonl", run_dir / "eval_sft.jsonl"),
            *(
                (
                    pass_path(self.sft / "eval_tuned.jsonl", k),
                    pass_path(run_dir / "eval_sft.jsonl", k),
                )
                for k in PASSES
            ),
            (src, run_dir / "eval_sft.json"),
        ):
            if a.is_file():
                atomic_write(b, lambda tmp, a=a: shutil.copyfile(a, tmp))
        self.evals["sft"] = json.loads(src.read_text())
        log.info(f"SFT alone: the evaluation of {self.sft} (same data and settings)")
        return True

    def before_lora(self, run: Run) -> None:
        pass  # the baseline is the SFT adapter (prepare_data), not the base model

    def after_training(self, run: Run, summary: dict) -> None:
        self.evals[f"sft + {run.cfg.objective}"] = self.evaluate(run, "tuned")
        summary["eval"] = self.evals

    def report_text(self, run: Run, summary: dict) -> str:
        return report(run, self.cfg, summary, self.evals, self.command)


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def report(run: Run, task: ChunkPrefConfig, summary: dict, evals: dict, command=None) -> str:
    """The experiment's README: question, command, config, SFT vs SFT + preference, the pairs,
    the training curve's ends, per-case boundary F1 of both, memory and time."""
    import platform

    import mlx.core as mx

    from mlxlab.eval import chunk as ev

    cfg, run_dir = run.cfg, run.run_dir
    pairs = json.loads((run_dir / "data" / "pairs.json").read_text())
    tuned = f"sft + {cfg.objective}"
    how = summary.get("gradients", "")
    objective = (
        f"DPO (beta {cfg.dpo.beta}, {cfg.dpo.loss}, reference = the SFT adapter)"
        if cfg.objective == "dpo"
        else f"ORPO (lambda {cfg.orpo.lam})"
    )
    lines = [
        f"# {cfg.name}",
        "",
        "## Question",
        "",
        f"Does {cfg.objective.upper()} on pairs made from the SFT adapter's own mistakes teach "
        f"{cfg.model} where the topic of a conversation changes, beyond what SFT alone learned, "
        "without losing the answer's form?",
        "",
        "## Command",
        "",
        "```bash",
        "python -m mlxlab train " + (command or "..."),
        "```",
        "",
        f"On top of the SFT run `{pairs['sft']}` (`python -m mlxlab train +exp=chunk_seg4`): its "
        "adapter starts this run, its data gives the pairs and the evaluation split.",
        "",
        "## Config",
        "",
        f"- objective: {objective}; steps {cfg.iters} x batch {cfg.batch_size} pairs, "
        f"{cfg.optim.name} lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup}, {cfg.optim.schedule}; "
        f"max_seq_length {cfg.data.max_seq_length}",
        f"- gradients: {how}",
        f"- pairs: {pairs['pairs']} from {pairs['examples']} training examples "
        f"({pairs['multi_chunk_examples']} with two or more gold chunks) of {pairs['windows']}: "
        f"{pairs['pairs_sampled']} of the SFT adapter's sampled answers (temperature "
        f"{pairs['temperature']}) that were wrong ({pairs['sampled_right']} were right), "
        f"{pairs['pairs_moved']} gold answers with a boundary moved by one message; sampled in "
        f"{fmt_minutes(pairs['seconds'])}",
        f"- evaluation: {task.eval.split} split, greedy, max_tokens {task.eval.max_tokens}, "
        f"batch {task.eval.batch_size}"
        + ev.bias_note(task.eval)
        + ev.constrained_note(task.eval)
        + ev.shifts_note(task.eval),
        f"- machine: {platform.system()} {platform.machine()}, {mx.default_device()}, "
        f"mlx {getattr(mx, '__version__', '?')}",
        "",
        f"## Result ({task.eval.split} split, topics never seen in training)",
        "",
        ev.table(evals),
        "",
    ]
    lines += ev.detector_lines(evals)
    steps = _steps(run_dir)
    if steps:
        keys = [
            k for k in ("loss", "reward_margin", "pref_accuracy", "log_odds_ratio") if k in steps[0]
        ]
        head, tail = steps[: min(8, len(steps))], steps[-min(8, len(steps)) :]
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        lines.append(
            "- training, mean of the first / last 8 steps: "
            + ", ".join(f"{k} {mean(head, k):.3f} -> {mean(tail, k):.3f}" for k in keys)
        )
    lines += [
        f"- peak memory: training {summary['peak_mem_gb']:.2f} GB"
        + "".join(
            f", {k} evaluation {v['peak_mem_gb']:.2f} GB"
            for k, v in evals.items()
            if "peak_mem_gb" in v
        ),
        f"- wall time: {fmt_minutes(summary['wall_s'])} in all (pairs {fmt_minutes(pairs['seconds'])}, "
        f"training {fmt_minutes(summary['seconds'])}, "
        + ", ".join(f"{k} evaluation {fmt_minutes(v['seconds'])}" for k, v in evals.items())
        + "; SFT alone reused from its run costs nothing here)",
        "",
        "Metrics as in `experiments/chunk_seg4/README.md`: ref = the predecessor's chunk-eval (the "
        "one compared with 95.10), strict = gaps and overlaps also zero the anchors; boundary F1 "
        "over chunk starts, F1 multi-topic on the conversations with two or more gold chunks.",
        "",
    ]
    rows = {}
    for name, path in (("sft", run_dir / "eval_sft.jsonl"), (tuned, run_dir / "eval_tuned.jsonl")):
        if path.is_file():
            rows[name] = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
    if len(rows) == 2:
        lines += [
            "## Per case (boundary F1 / ref)",
            "",
            f"| case | gold chunks | sft | {tuned} |",
            "|---|---|---|---|",
        ]
        for cid, r in rows[tuned].items():
            s = rows["sft"].get(cid, {})
            lines.append(
                f"| {cid} | {r.get('gold_chunks', '?')} | {ev._fmt(s.get('boundary_f1'), 2)} / "
                f"{ev._fmt(s.get('ref'))} | {ev._fmt(r.get('boundary_f1'), 2)} / {ev._fmt(r.get('ref'))} |"
            )
        lines.append("")
    lines += [
        "## Files",
        "",
        f"Run directory `{run_dir}`: `adapter/`, `metrics.jsonl`, `summary.json`, `config.yaml`, "
        "`data/` (the pairs `train.jsonl`, `pairs.json`, the SFT run's cases), per-case "
        "`eval_sft.jsonl` / `eval_tuned.jsonl`.",
        "",
    ]
    return "\n".join(lines)
