"""Admin request and response models (errors answer in the OpenAI shape)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MountRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        json_schema_extra={"not": {"enum": ["none", "base"]}},  # what requests say for no adapter
    )
    path: str = Field(min_length=1, pattern=r"^[^\x00]+$")  # no NUL: no file name has one
    # the served model to mount it on (loaded first if it is not); None: the default model
    model: str | None = Field(default=None, min_length=1)


class Health(BaseModel):
    """GET /health's body (200 when ready, 503 while loading, failed or draining)."""

    status: str
    model: str
    error: str | None = None
