"""Preference training on the chunk task: DPO, ORPO or GRPO on top of a chunk SFT run's adapter
(`train +exp=chunk_dpo`, `+exp=chunk_orpo`, `+exp=chunk_grpo`, or `train task=chunk_pref
objective=...`).

The pairs come from the SFT run's own training split (windows.py `training_windows`,
the windows it trained on). For `examples` of them, most with two or more gold chunks, the SFT
adapter writes an answer by sampling; each answer that is wrong (its chunks are not the gold's,
or it does not score 100) becomes a pair with the gold answer as chosen and it as rejected, and
each picked multi-chunk example also pairs its gold with the gold's one boundary moved by one
message. GRPO (`objective=grpo`) samples nothing here: the picked examples are written as
prompt records (reward.py `prompt_record`: the SFT example's prompt with the window's uuids and
gold), which the policy answers in groups during training, scored by reward.py `chunk_reward`.
The run starts from the SFT adapter (lora.init; for DPO it is also the reference), is
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

from mlxlab.config import DataConfig, to_dict
from mlxlab.errors import UserError
from mlxlab.tasks.chunk.config import ChunkDataConfig, ChunkPrefConfig
from mlxlab.tasks.chunk.dataset import dataset_dir
from mlxlab.tasks.chunk.prompt import answer, conversation_uuid, prompt
from mlxlab.tasks.chunk.reward import prompt_record
from mlxlab.tasks.chunk.scoring import score_case
from mlxlab.tasks.chunk.task import ChunkTask
from mlxlab.tasks.chunk.windows import training_windows
from mlxlab.train.config import TrainConfig
from mlxlab.train.job import Run

log = logging.getLogger(__name__)

SFT_RUNS = Path("outputs", "chunk_seg4")
"""Where the newest finished chunk SFT run is looked for when `task.sft` is unset."""
COPIED = (
    "train.cases.json",
    "valid.cases.json",
    "test.cases.json",
    "dev.cases.json",
    "export.cases.json",
    "build.json",
)
"""The SFT run's data files this run's data/ holds: every split task.eval.split may name."""


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


WINDOW_KEYS = ("window_chars", "window_overlap", "window_messages")
"""The settings windows.py `training_windows` reads."""


def _data_config(build: dict):
    """The SFT run's window settings from its build.json, the rest defaults (a build.json also
    holds its sources' report under a setting's name: `sharegpt`). A dataset built before
    windows were capped, `window_messages` 0, is read as it was built: whole conversations
    within window_chars."""
    from mlxlab.schema import from_dict

    settings = {k: build[k] for k in WINDOW_KEYS if k in build}
    if not settings.get("window_messages"):
        settings["window_messages"] = 1000
    return from_dict(ChunkDataConfig, settings)


def pick(windows: list, n: int, multi_share: float, rng: random.Random) -> list:
    """`n` of the (case, messages, gold) windows: round(n * multi_share) with two or more gold
    chunks (fewer if there are fewer), the rest with one, each group in a seeded order."""
    multi = [w for w in windows if len(w[2]) >= 2]
    single = [w for w in windows if len(w[2]) < 2]
    rng.shuffle(multi)
    rng.shuffle(single)
    k = min(len(multi), round(n * multi_share))
    return multi[:k] + single[: n - k]


def moved_boundary(gold: list[dict], uuids: list[str], rng: random.Random) -> list[dict] | None:
    """`gold` (chunks over `uuids`, in order) with one boundary between two chunks moved by one
    message, earlier or later, keeping every chunk non-empty; None for a one-chunk gold."""
    index = {u: i for i, u in enumerate(uuids)}
    spans = [[index[c["start_message_uuid"]], index[c["end_message_uuid"]]] for c in gold]
    options = []
    for k in range(1, len(spans)):
        if spans[k - 1][1] > spans[k - 1][0]:  # the earlier chunk can give its last message
            options.append((k, -1))
        if spans[k][1] > spans[k][0]:  # the later chunk can give its first message
            options.append((k, +1))
    if not options:
        return None
    k, step = rng.choice(options)
    spans[k - 1][1] += step
    spans[k][0] += step
    return [
        {**c, "start_message_uuid": uuids[s], "end_message_uuid": uuids[e]}
        for c, (s, e) in zip(gold, spans, strict=True)
    ]


def is_right(text: str, uuids: list[str], gold: list[dict], conversation_uuid) -> bool:
    """An answer is right when both scorers give it full marks and its chunks are the gold's."""
    s = score_case(text, uuids, gold, conversation_uuid)
    return (
        s.ref == 100.0 and s.wellformed == 100.0 and s.exact_match == 1.0 and s.boundary_f1 == 1.0
    )


def sft_windows(sft_data: Path) -> list:
    """The (case, messages, gold) windows of the SFT run's training split, as it trained on them
    (its build.json's settings)."""
    dcfg = _data_config(json.loads((sft_data / "build.json").read_text()))
    cases = json.loads((sft_data / "train.cases.json").read_text())
    return [(c, msgs, gold) for c in cases for msgs, gold in training_windows(c, dcfg)]


def build_prompts(sft_data: Path, cfg: ChunkPrefConfig) -> tuple[list[dict], dict]:
    """(GRPO prompt records, stats): `cfg.examples` windows of the SFT run's training split,
    picked as `build_pairs` picks them, each as reward.py `prompt_record` writes it."""
    t0 = time.perf_counter()
    windows = sft_windows(sft_data)
    picked = pick(windows, cfg.examples, cfg.multi_share, random.Random(cfg.seed))
    records = [prompt_record(c, msgs, gold) for c, msgs, gold in picked]
    stats = {
        "windows": len(windows),
        "examples": len(picked),
        "multi_chunk_examples": sum(len(g) >= 2 for _, _, g in picked),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return records, stats


def build_pairs(model, tokenizer, sft_data: Path, cfg: ChunkPrefConfig, batch_size: int = 8):
    """(pair records, stats): the SFT model's sampled wrong answers and the moved-boundary golds
    against the gold answers, over windows of the SFT run's training split."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.decode.offline import complete

    windows = sft_windows(sft_data)
    rng = random.Random(cfg.seed)
    picked = pick(windows, cfg.examples, cfg.multi_share, rng)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt(c, msgs)}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for c, msgs, _ in picked
    ]
    t0 = time.perf_counter()
    mx.random.seed(cfg.seed)
    texts = complete(
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
        user = [{"role": "user", "content": prompt(case, msgs)}]
        # as the SFT data writes it
        chosen = answer(gold)
        if is_right(text, uuids, gold, conversation_uuid(case)):
            right += 1
        elif text.strip():
            pairs.append(
                {"messages": user, "chosen": chosen, "rejected": text.strip(), "kind": "sampled"}
            )
            kinds["sampled"] += 1
        moved = moved_boundary(gold, uuids, rng) if cfg.moved else None
        if moved is not None:
            pairs.append(
                {
                    "messages": user,
                    "chosen": chosen,
                    "rejected": answer(moved),
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
    """Pairs (or GRPO's prompt records) into <run>/data (for pairs, the SFT model loaded on its
    own, then freed), lora.init = the SFT adapter, evaluation of SFT alone (reused from its run
    when the settings match) and of the tuned model, the report."""

    def __init__(self, cfg: ChunkPrefConfig, command: str | None = None):
        super().__init__(cfg, command)
        self.sft: Path | None = None
        self.train_cfg: TrainConfig | None = None

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        if cfg.objective == "sft":
            raise UserError(
                "task=chunk_pref trains on top of an SFT run: set objective=dpo, objective=orpo "
                "or objective=grpo"
            )
        if cfg.objective == "grpo" and not any(
            r.startswith("mlxlab.tasks.chunk.") for r in cfg.grpo.rewards
        ):
            log.warning(
                "warning: objective=grpo on the chunk task without a chunk reward in grpo.rewards "
                "(mlxlab.tasks.chunk.reward:chunk_reward): the records' gold goes unscored"
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
            self.check_windows(dataset_dir(data.train))
            return data
        data_dir = run_dir / "data"
        self.check_windows(self.sft / "data")  # its build.json is the one copied below
        data = dataclasses.replace(data, train=str(data_dir))
        cfg = self.train_cfg
        built = (data_dir / "train.jsonl").is_file()
        if cfg.objective == "grpo" and not built:  # prompt records: no model needed
            atomic_dir(data_dir, self._write_prompts)
            built = True
        reused = self._reuse_sft_eval(run_dir)
        if built and reused:
            return data
        import gc

        import mlx.core as mx

        from mlxlab.lora import io as lora_io
        from mlxlab.models.zoo import load

        model, tokenizer = load(cfg.model, cfg.dtype)
        lora_io.load(model, self.sft)
        if not built:
            atomic_dir(data_dir, lambda tmp: self._write_pairs(tmp, model, tokenizer))
        if not reused:  # SFT alone, on this run's copy of the data and these settings
            self.evals["sft"] = self.evaluate(Run(cfg, run_dir, data, model, tokenizer), "sft")
        model = tokenizer = None  # freed before training loads its own copy
        gc.collect()
        mx.clear_cache()
        return data

    def _copy_sft_data(self, tmp: Path) -> None:
        for name in COPIED:
            if (self.sft / "data" / name).is_file():
                shutil.copy(self.sft / "data" / name, tmp / name)

    def _write_prompts(self, tmp: Path) -> None:
        """GRPO's prompt records (train.jsonl) and their stats (prompts.json) into `tmp`."""
        self._copy_sft_data(tmp)
        records, stats = build_prompts(self.sft / "data", self.cfg)
        with (tmp / "train.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        (tmp / "prompts.json").write_text(
            json.dumps({**stats, "sft": str(self.sft)}, indent=1) + "\n"
        )
        log.info(
            f"prompts: {stats['examples']} training windows ({stats['multi_chunk_examples']} "
            f"with two or more gold chunks) of {stats['windows']}"
        )

    def _write_pairs(self, tmp: Path, model, tokenizer) -> None:
        """The preference pairs (train.jsonl) and their stats (pairs.json) into `tmp`."""
        self._copy_sft_data(tmp)
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
        # options since retired: the run decoded as this one does only at their fixed values
        now = to_dict(self.cfg.eval)
        retired = {k: saved.pop(k) for k in list(saved) if k not in now}
        if retired and (
            not {"cover", "read_overruled"} <= set(retired)  # before either: decoded otherwise
            or retired["cover"] is not False  # (before eval.cover: under a JSON schema)
            or any(retired.get(k) for k in ("read_overruled", "turns", "starts", "split_bias"))
        ):
            return False  # decoded otherwise than this evaluation does
        # settings added since the SFT run: their defaults; label_model only adds a score (a run
        # without it shows none for SFT alone), so it does not stop the reuse
        saved = {
            **to_dict(type(self.cfg.eval)()),
            **saved,
            "label_model": self.cfg.eval.label_model,
        }
        if not src.is_file() or saved != to_dict(self.cfg.eval):
            return False
        from mlxlab.fsutil import atomic_write
        from mlxlab.tasks.chunk.evaluate import pass_path
        from mlxlab.tasks.chunk.metrics import PASSES

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
        from mlxlab.tasks.chunk.report import pref_report

        return pref_report(run, self.cfg, summary, self.evals, self.command)
