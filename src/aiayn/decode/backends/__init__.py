"""What the exported-model backends share: importing an optional peer runtime with a message
that says how to install it, and the model stand-in that `Translator` drives."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from aiayn.config import ModelConfig
from aiayn.extras import MissingExtra

INSTALL = "pip install -e '.[export]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import an optional dependency, or fail with the line that installs it.

    Raises:
        MissingExtra: `module` is missing (an ImportError that the CLI prints as one line); the
            message names `purpose` and the pip command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(
            f"{purpose} needs the optional package {module!r} ({error}); run: {INSTALL}"
        ) from error


class ExportedModel:
    """A model that runs outside PyTorch, as `Translator` sees it: its `ModelConfig` (source
    length limits, positions), the device its inputs go to, and train/eval switches that do
    nothing, because an exported graph has no training mode."""

    training = False

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def eval(self) -> ExportedModel:
        return self

    def train(self, mode: bool = True) -> ExportedModel:
        if mode:
            raise RuntimeError(f"{type(self).__name__} is an exported model: it cannot be trained")
        return self

    def forward_with_attention(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} cannot return per-head attention maps "
            "(return_attention=True); translate with the PyTorch model directory for them"
        )
