"""`python -m mlxlab runs`: the runs page on its own, without a model.

    python -m mlxlab runs                         # the runs under ./outputs on http://127.0.0.1:8091/runs
    python -m mlxlab runs dir=~/experiments port=8092 api_key=sk-mine

It lists the training runs under `dir` and plots their metrics as they train, like `serve`'s
/runs (which can also mount a run's adapter: this one has no model). The HTTP side is `serve`'s:
the same Host/Origin/key checks (`api_key`, MLXLAB_API_KEY, `api_key_file`, `allowed_hosts`,
`cors_origins`), header and body deadlines, connection cap. Ctrl-C stops it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from mlxlab.cli import run_hydra
from mlxlab.errors import UserError
from mlxlab.serve.cli import check_port, uvicorn_config
from mlxlab.serve.config import RunsConfig
from mlxlab.serve.guard import is_loopback, load_keys
from mlxlab.serve.web.app import create_runs_app
from mlxlab.train import runs

log = logging.getLogger(__name__)


def run(cfg: RunsConfig) -> None:
    http = cfg.http()
    root = Path(cfg.dir).expanduser().resolve()
    if not root.is_dir():
        raise UserError(
            f"runs.dir={cfg.dir}: no such directory (train writes its runs under outputs/; "
            "give dir=...)"
        )
    keys = load_keys(http)
    if not keys.api and keys.admin is None and not is_loopback(cfg.host):
        log.warning(
            "mlxlab runs: warning: listening on %s without an API key: anyone who can reach this "
            "address can read the runs' metrics and configs; set api_key=...",
            cfg.host,
        )
    check_port(cfg.host, cfg.port)
    app = create_runs_app(http, root, keys)
    server = uvicorn.Server(uvicorn_config(http, app))
    found = len(runs.find(root))
    log.info(
        "mlxlab runs: http://%s:%d/runs | %d run%s under %s",
        cfg.host,
        cfg.port,
        found,
        "" if found == 1 else "s",
        root,
    )
    server.run()


def main(argv: list[str]) -> None:
    run_hydra("runs", argv, run)
