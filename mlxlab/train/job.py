"""One training job, as a library call: run directory, model, data, LoRA, the loop, the adapter.

`run(cfg, hooks)` is what `python -m mlxlab train` runs. What a task adds around the loop (build
its dataset, evaluate the base and the tuned model, write a report: mlxlab/tasks/) comes in as a
`Hooks` object; this module knows no task, no evaluation and no Hydra.

Started by `mlx.launch` (several processes), the job joins the world first (train/world.py),
prints it, and trains data-parallel (train/parallel.py) or, with backward.pipeline, as a segment
pipeline (train/pipeline.py); rank 0 alone checks and writes the run directory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from mlxlab.config import DataConfig, TrainConfig, to_dict
from mlxlab.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What the hooks see of a job in progress."""

    cfg: TrainConfig
    run_dir: Path
    data: DataConfig
    """The data config trained on (after `Hooks.prepare_data`)."""
    model: object = None
    tokenizer: object = None


class Hooks:
    """What a task adds around the training loop; every method may be left as it is (no-op)."""

    def config(self) -> dict | None:
        """Saved as `task` in the run's config.yaml (and checked on resume)."""
        return None

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        """The config to train with: a task may fill settings it owns (the adapter to start
        from, lora.init, when it trains on top of another run)."""
        return cfg

    def prepare_data(self, data: DataConfig, run_dir: Path) -> DataConfig:
        """The data config to train on (a task builds its dataset into the run directory)."""
        return data

    def before_lora(self, run: Run) -> None:
        """The base model is loaded, no LoRA attached yet."""

    def after_training(self, run: Run, summary: dict) -> None:
        """The final adapter is saved; anything added to `summary` goes into summary.json."""

    def finish(self, run: Run, summary: dict) -> None:
        """summary.json is written (with `wall_s` and `gradients`)."""


def run_dir_for(cfg: TrainConfig) -> Path:
    if cfg.out_dir:
        return Path(cfg.out_dir).expanduser().absolute()
    return Path("outputs", cfg.name, time.strftime("%Y%m%d-%H%M%S")).absolute()


# Settings that do not change the training trajectory (iters does, through the cosine schedule,
# but extending a run is the point of changing it).
RESUME_MAY_CHANGE = (
    "resume",
    "out_dir",  # where the run is, not what it does: a timestamped run resumes by it
    "iters",
    "save_every",
    "keep_last",
    "log_every",
    "val_every",
    "val_batches",
    "wandb",
    "wandb_project",
    "dist",
)


def _fill_missing(saved: dict, defaults: dict) -> None:
    """Settings added since `saved` was written take their defaults (what the run had)."""
    for k, v in defaults.items():
        if k not in saved:
            saved[k] = v
        elif isinstance(saved[k], dict) and isinstance(v, dict):
            _fill_missing(saved[k], v)


def _check_resume_config(run_dir: Path, now: dict, defaults: dict | None = None) -> None:
    """A resumed run must be the same run: only the length and bookkeeping may differ.
    `defaults` (the config's defaults) fill settings added since the run was started."""
    import yaml

    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        raise UserError(f"resume=true but {saved_path} is missing; is {run_dir} a run directory?")
    saved = yaml.safe_load(saved_path.read_text())
    if isinstance(saved.get("task"), dict) and saved["task"].get("name") is None:
        saved.pop("task")  # written before tasks were their own configs: no task
    _fill_missing(saved, defaults or {})
    differ = sorted(
        k
        for k in set(saved) | set(now)
        if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k)
    )
    if differ:
        raise UserError(
            f"resume=true with a different config than {saved_path}: {', '.join(differ)}"
        )


def _join(world, cfg: TrainConfig, hooks: Hooks) -> None:
    """Print the world (rank 0; the other ranks print warnings and errors only) and refuse
    what does not run on several processes."""
    import logging as logging_

    if world.writer:
        log.info(world.describe())
    else:  # warnings and errors only, marked with the rank
        logger = logging_.getLogger("mlxlab")
        logger.setLevel(logging_.WARNING)
        prefix = f"[rank {world.rank}] "

        def mark(record):
            record.msg, record.args = prefix + record.getMessage(), ()
            return True

        for handler in logger.handlers:
            handler.addFilter(mark)
    if type(hooks) is not Hooks:
        raise UserError(
            "a task run (task=..., e.g. +exp=chunk_seg4) builds and evaluates on one process; "
            "under mlx.launch train its data directly (data.train=DIR)"
        )
    if not cfg.backward.pipeline and cfg.batch_size % world.size:
        raise UserError(
            f"batch_size={cfg.batch_size} is not a multiple of the {world.size} processes: "
            "data parallel gives each rank batch_size / world size of every batch"
        )


def run(cfg: TrainConfig, hooks: Hooks | None = None) -> dict:
    """Train a LoRA adapter as `cfg` says; return the summary (also in <run>/summary.json)."""
    import yaml

    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import load_split, resolve_paths
    from mlxlab.fsutil import atomic_write_text, writable_dir
    from mlxlab.lora import apply as lora_apply
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load
    from mlxlab.train import trainer
    from mlxlab.train.backward import make_grad_fn
    from mlxlab.train.objectives import PairObjective
    from mlxlab.train.world import World

    hooks = hooks or Hooks()
    cfg = hooks.train_config(cfg)
    world = World.start(cfg.dist)  # None: this process trains alone
    if world is not None:
        _join(world, cfg, hooks)
    writer = world is None or world.writer
    run_dir = run_dir_for(cfg)
    config_dict = to_dict(cfg)
    task_config = hooks.config()
    if task_config is not None:
        config_dict["task"] = task_config

    def check_run_dir():
        if cfg.resume:
            defaults = to_dict(TrainConfig())
            task_cfg = getattr(hooks, "cfg", None)
            if task_config is not None and dataclasses.is_dataclass(task_cfg):
                defaults["task"] = to_dict(type(task_cfg)())
            _check_resume_config(run_dir, config_dict, defaults)
        elif run_dir.exists() and not run_dir.is_dir():
            raise UserError(f"out_dir={run_dir} is a file; a run needs a directory")
        elif run_dir.exists() and any(run_dir.iterdir()):
            raise UserError(
                f"{run_dir} is not empty; pick another out_dir, or resume=true to continue it"
            )

    if world is None:
        check_run_dir()
    else:  # rank 0's run directory; every rank stops on its refusal
        world.agree(check_run_dir, "checking the run directory")
    pipeline = world is not None and cfg.backward.pipeline
    if cfg.backward.pipeline and world is None:
        log.warning(
            "warning: backward.pipeline=true needs several processes (mlx.launch -n K ...); "
            "this one trains alone with the segmented backward"
        )
    t_start = time.perf_counter()
    data_cfg = hooks.prepare_data(cfg.data, run_dir)
    train_path, valid_path = resolve_paths(data_cfg)
    # No bf16 copy of the LM head for decode: training's products are many-row ones (BLAS).
    # A pipeline stage loads lazily: the layers it does not hold are never read (pipeline.py).
    model, tokenizer = load(cfg.model, cfg.dtype, decode_head="exact", lazy=pipeline)
    pairs = cfg.objective != "sft"
    per_unit = 2 if pairs else 1  # rows per sampler unit (a pair's two sides)
    if pairs:
        from mlxlab.data.preference import load_pair_split as load_split  # noqa: F811
    train_set = load_split(train_path, tokenizer, data_cfg)
    valid_set = load_split(valid_path, tokenizer, data_cfg) if valid_path else None
    job = Run(cfg, run_dir, data_cfg, model, tokenizer)
    hooks.before_lora(job)

    if cfg.data.pack:
        from mlxlab.models.runners import RUNNERS, runner_for

        try:
            runner_for(model)
        except UserError:
            raise UserError(
                f"data.pack needs a layer runner for the block-diagonal masks; model type "
                f"{getattr(model, 'model_type', '?')!r} has none (supported: "
                f"{', '.join(sorted(RUNNERS))})"
            ) from None
    plan = lora_apply.plan(model, cfg.lora)
    lora_apply.apply(model, plan, seed=cfg.seed)
    start = None  # the adapter the run starts from (lora.init): DPO's reference too
    if cfg.lora.init:
        import mlx.core as mx

        start = lora_io.read_init(cfg.lora.init, model, plan)
        model.load_weights(list(start.items()), strict=False)
        if not pipeline:  # a pipeline stage reads only the arrays it holds
            mx.eval(model.parameters())
        log.info(f"LoRA starts from {lora_io.resolve_dir(cfg.lora.init)}")
    objective = PairObjective.from_config(cfg, start)
    dist, shard = None, (0, 1)
    if pipeline:
        from mlxlab.train.pipeline import Pipeline

        rows = [(len(e.ids) - 1, len(e.ids) - max(e.offset, 1)) for e in train_set.examples]
        dist = Pipeline.build(world, model, cfg, rows, start)
    elif world is not None:
        from mlxlab.train.parallel import DataParallel

        dist, shard = DataParallel(world), (world.rank, world.size)
        log.info(
            f"data parallel: each rank trains on {cfg.batch_size // world.size} of every "
            f"{cfg.batch_size} {'pairs' if pairs else 'examples'}; rank 0 writes {run_dir}"
        )
    train_sampler = BatchSampler(
        train_set.examples,
        cfg.batch_size,
        cfg.seed,
        pack_length=cfg.data.max_seq_length if cfg.data.pack else 0,
        pairs=pairs,
        shard=shard,
    )
    valid_sampler = (
        BatchSampler(
            valid_set.examples,
            min(cfg.batch_size, len(valid_set.examples) // per_unit),
            cfg.seed,
            shuffle=False,
            pairs=pairs,
            shard=shard,
        )
        if valid_set
        else None
    )
    if writer:
        writable_dir(run_dir)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config_dict, sort_keys=False))
    if cfg.objective == "dpo":  # after config.yaml: a run killed here can resume
        if dist is None:
            from mlxlab.train.objectives import precompute_reference
        else:  # shared by the ranks; rank 0 reads and writes the file
            precompute_reference = dist.precompute_reference

        for sampler, name, needed in (
            (valid_sampler, "valid", valid_sampler is not None and cfg.val_every),
            (train_sampler, "train", cfg.dpo.precompute_ref),
        ):  # validation always gets fixed reference log-probs
            if needed:
                path = run_dir / f"reference_{name}.json"
                precompute_reference(model, sampler, path, cfg.model, start)
    n_params = sum(v.size for v in lora_apply.adapter_parameters(model).values())
    log.info(
        f"run dir: {run_dir}\nmodel: {cfg.model} ({cfg.dtype}) | LoRA rank {plan.rank} on "
        f"{len(plan.keys)} projections x {len(plan.layers)} layers ({n_params / 1e6:.2f}M params)\n"
        f"data: {len(train_set.examples) // per_unit} train / "
        f"{len(valid_set.examples) // per_unit if valid_set else 0} valid "
        + ("pairs" if pairs else "examples")
    )
    unpacked = (
        BatchSampler(train_set.examples, cfg.batch_size, cfg.seed).padding()
        if cfg.data.pack
        else None
    )
    log.info(
        f"padding: {train_sampler.padding():.1%} of an epoch's batch positions"
        + (
            f" packed ({len(train_sampler)} batches of {cfg.batch_size} rows holding "
            f"{train_sampler.examples_per_epoch()} examples), {unpacked:.1%} unpacked"
            if unpacked is not None
            else f" ({len(train_sampler)} batches of {cfg.batch_size})"
        )
    )
    if pipeline:
        grad_fn, how = dist.grad_fn(), dist.describe()
    else:
        grad_fn, how = make_grad_fn(
            model,
            cfg.backward,
            (cfg.batch_size * per_unit, cfg.data.max_seq_length),
            compile=cfg.compile,
            objective=objective,
        )
    log.info(f"gradients: {how}")
    meta = {"base_model": cfg.model, "run_dir": str(run_dir)}
    if writer:
        run_log = trainer.RunLog(run_dir, cfg.iters, cfg.wandb, cfg.wandb_project, config_dict)
    else:
        run_log = trainer.QuietLog()
    summary = trainer.train(
        model,
        plan,
        train_sampler,
        valid_sampler,
        cfg,
        run_dir,
        grad_fn=grad_fn,
        run_log=run_log,
        meta=meta,
        dist=dist,
    )
    if dist is None:
        adapter_dir = lora_io.save(model, plan, run_dir / "adapter", meta=meta)
    else:  # rank 0 writes (the pipeline gathers the stages' arrays first)
        adapter_dir = dist.save_adapter(model, plan, run_dir / "adapter", meta)
    if not writer:
        return summary  # rank 0 reports the run
    summary["adapter"] = str(adapter_dir)
    hooks.after_training(job, summary)
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    summary["gradients"] = how
    if world is not None:
        summary["world"] = {**dist.world_info(), "backend": world.backend, "hosts": world.hosts}
    trainer.write_summary(run_dir, summary)
    hooks.finish(job, summary)
    val = summary.get("val_loss")
    first = summary.get("initial_val_loss")
    if val is not None:
        change = f" (from {first:.4f})" if first is not None else ""
        log.info(f"final val loss {val:.4f}{change}")
    log.info(f"done in {summary['seconds']:.0f} s, peak memory {summary['peak_mem_gb']:.2f} GB")
    return summary
