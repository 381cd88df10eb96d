"""mlxlab's command line: `python -m mlxlab <command> [key=value ...]`.

Each command is Hydra-configured from configs/<command>.yaml; `--cfg job` prints the resolved
config and `--help` the command's options.
"""

from __future__ import annotations

import importlib
import sys

import mlxlab  # noqa: F401  (loads the optimized BLAS before anything imports MLX)

# command -> (module with main(argv), or module:function taking argv; one-line summary). Only
# commands that work are listed.
COMMANDS = {
    "generate": (
        "mlxlab.generate",
        "stream text from a model (prompt=..., chat=true, max_tokens=...)",
    ),
    "models": ("mlxlab.models.cli", "the model zoo: list | pull NAME | convert FILE.gguf | info"),
    "train": (
        "mlxlab.train.cli",
        "LoRA fine-tuning (+exp=quickstart, data.train=..., resume=true)",
    ),
    "lora": ("mlxlab.lora.cli", "adapters: check adapter=DIR | fuse adapter=DIR out=DIR"),
    "diag": ("mlxlab.diag.cli", "harnesses: parity (vs mlx-lm) | leak | memory"),
    "serve": (
        "mlxlab.serve.cli",
        "OpenAI-compatible HTTP server (model=..., port=8090, memory_budget_gb=...)",
    ),
    "data": ("mlxlab.verbs:data", "build a task dataset offline: chunk out=DIR"),
    "eval": ("mlxlab.verbs:eval", "score a model/adapter on a task: chunk adapter=DIR"),
    "runs": ("mlxlab.serve.web.cli", "the training runs page on its own (dir=outputs, port=8091)"),
    "transcribe": (
        "mlxlab.audio.cli",
        "speech to text with Whisper: FILE [language=en format=srt task=translate out=FILE]",
    ),
}

USAGE = (
    "usage: python -m mlxlab <command> [key=value ...] [--cfg job] [--help]\n\ncommands:\n"
    + "".join(f"  {name:<10} {summary}\n" for name, (_, summary) in COMMANDS.items())
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mlxlab: unknown command {name!r}\n\n{USAGE}", end="", file=sys.stderr)
        sys.exit(2)
    module, _, function = COMMANDS[name][0].partition(":")
    getattr(importlib.import_module(module), function or "main")(rest)


if __name__ == "__main__":
    main()
