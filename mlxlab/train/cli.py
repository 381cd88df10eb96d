"""LoRA fine-tuning from the command line.

    python -m mlxlab train +exp=quickstart                  # bundled data, gemma3-270m, minutes
    python -m mlxlab train data.train=my_data/ lora.rank=16 iters=500
    python -m mlxlab train +exp=quickstart out_dir=outputs/q resume=true   # continue a killed run

The run directory gets the final adapter (`adapter/`, mlx-lm's layout), checkpoints, metrics.jsonl,
summary.json and the resolved config.yaml; the last line printed is the adapter's path.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mlxlab.config import TrainConfig, UserError, run_hydra, to_dict


def run_dir_for(cfg: TrainConfig) -> Path:
    if cfg.out_dir:
        return Path(cfg.out_dir).expanduser().absolute()
    return Path("outputs", cfg.name, time.strftime("%Y%m%d-%H%M%S")).absolute()


# Settings that do not change the training trajectory (iters does, through the cosine schedule,
# but extending a run is the point of changing it).
RESUME_MAY_CHANGE = ("resume", "iters", "save_every", "keep_last", "log_every", "val_every",
                     "val_batches", "wandb", "wandb_project")


def _check_resume_config(run_dir: Path, cfg: TrainConfig) -> None:
    """A resumed run must be the same run: only the length and bookkeeping may differ."""
    import yaml

    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        raise UserError(f"resume=true but {saved_path} is missing; is {run_dir} a run directory?")
    saved, now = yaml.safe_load(saved_path.read_text()), to_dict(cfg)
    differ = sorted(k for k in set(saved) | set(now)
                    if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k))
    if differ:
        raise UserError(f"resume=true with a different config than {saved_path}: {', '.join(differ)}")


def run(cfg: TrainConfig) -> dict:
    import yaml

    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import load_split, resolve_paths
    from mlxlab.fsutil import atomic_write_text, writable_dir
    from mlxlab.lora import apply as lora_apply
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load
    from mlxlab.train import tasks, trainer

    run_dir = run_dir_for(cfg)
    if cfg.resume:
        _check_resume_config(run_dir, cfg)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} is not empty; pick another out_dir, or resume=true to continue it")
    t_start = time.perf_counter()
    if cfg.task.name:
        writable_dir(run_dir)
    data_cfg = tasks.prepare_data(cfg, run_dir)
    train_path, valid_path = resolve_paths(data_cfg)
    model, tokenizer = load(cfg.model, cfg.dtype)
    train_set = load_split(train_path, tokenizer, data_cfg)
    valid_set = load_split(valid_path, tokenizer, data_cfg) if valid_path else None
    evals = {}
    if cfg.task.name and cfg.task.eval_base:
        evals["base"] = tasks.evaluate(model, tokenizer, cfg, data_cfg, run_dir, "base")

    plan = lora_apply.plan(model, cfg.lora)
    lora_apply.apply(model, plan, seed=cfg.seed)
    train_sampler = BatchSampler(train_set.examples, cfg.batch_size, cfg.seed)
    valid_sampler = (BatchSampler(valid_set.examples, min(cfg.batch_size, len(valid_set.examples)),
                                  cfg.seed, shuffle=False) if valid_set else None)

    writable_dir(run_dir)
    config_dict = to_dict(cfg)
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config_dict, sort_keys=False))
    n_params = sum(v.size for v in lora_apply.adapter_parameters(model).values())
    print(f"run dir: {run_dir}\nmodel: {cfg.model} ({cfg.dtype}) | LoRA rank {plan.rank} on "
          f"{len(plan.keys)} projections x {len(plan.layers)} layers ({n_params / 1e6:.2f}M params)\n"
          f"data: {len(train_set.examples)} train / {len(valid_set.examples) if valid_set else 0} "
          f"valid examples", file=sys.stderr)
    from mlxlab.train.backward import make_grad_fn

    grad_fn, how = make_grad_fn(model, cfg.backward, (cfg.batch_size, cfg.data.max_seq_length),
                                compile=cfg.compile)
    print(f"gradients: {how}", file=sys.stderr)
    meta = {"base_model": cfg.model, "run_dir": str(run_dir)}
    log = trainer.RunLog(run_dir, cfg.iters, cfg.wandb, cfg.wandb_project, config_dict)
    summary = trainer.train(model, plan, train_sampler, valid_sampler, cfg, run_dir,
                            grad_fn=grad_fn, log=log, meta=meta)
    adapter_dir = lora_io.save(model, plan, run_dir / "adapter", meta=meta)
    summary["adapter"] = str(adapter_dir)
    if cfg.task.name:
        evals["tuned"] = tasks.evaluate(model, tokenizer, cfg, data_cfg, run_dir, "tuned")
        summary["eval"] = evals
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    summary["gradients"] = how
    trainer.write_summary(run_dir, summary)
    if cfg.task.name:
        from mlxlab.eval.chunk import table

        text = tasks.report(cfg, run_dir, summary, evals, how, summary["wall_s"])
        atomic_write_text(run_dir / "README.md", text)
        if cfg.task.report:
            report_path = Path(cfg.task.report).expanduser().absolute()
            writable_dir(report_path.parent)
            atomic_write_text(report_path, text)
            print(f"report: {cfg.task.report}", file=sys.stderr)
        print(table(evals), file=sys.stderr)
    val = summary.get("val_loss")
    first = summary.get("initial_val_loss")
    if val is not None:
        change = f" (from {first:.4f})" if first is not None else ""
        print(f"final val loss {val:.4f}{change}", file=sys.stderr)
    print(f"done in {summary['seconds']:.0f} s, peak memory {summary['peak_mem_gb']:.2f} GB",
          file=sys.stderr)
    print(f"adapter: {adapter_dir}")
    return summary


def main(argv: list[str]) -> None:
    run_hydra("train", argv, run)
