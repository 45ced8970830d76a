"""The one registry of decoding methods: name -> decoder class. Importable without JAX.

    registry.names()                      # every method, in registration order
    registry.get("d2f")                   # its `protocol.Decoder` class (imported on first use)
    registry.register("mine", MyDecoder)  # a decoder defined anywhere, e.g. in a test file

The built-in decoders are registered below by import path, so the command line can check
`--method` (and whether it takes a drafter) in well under a second, before the ~5-10 s
import of JAX and flax. No other list of methods exists in the package: `generate`,
`stream`, the data-parallel driver, the serving engine, the `Sampler`, the CLI and the demo
all look methods up here.

The default method everywhere (`generate`, `stream`, `Sampler`, the serving `Engine`, the
command line) is `DEFAULT_METHOD`, D2F: the package's fast diffusion decoder.
"""

from __future__ import annotations

import dataclasses
import importlib

DEFAULT_METHOD = "d2f"


@dataclasses.dataclass
class _Entry:
  target: object            # the decoder class, or "module:Class" until first use
  uses_drafter: bool
  ranks: bool               # it ranks confidences, so it takes batch_invariant


_ENTRIES: dict[str, _Entry] = {}


def register(name: str, decoder, *, uses_drafter: bool | None = None,
             ranks: bool | None = None) -> None:
  """Registers `decoder` (a `protocol.Decoder` subclass, or its "module:Class" path) as
  method `name`; re-registering a name replaces it. `uses_drafter` (it takes a drafter
  model) and `ranks` (it takes batch_invariant) are read from the class when it is given as
  a class; a path names them, so the command line knows them without importing JAX."""
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"a method name must be an identifier, got {name!r}.")
  if not isinstance(decoder, str):
    decoder.name = name
    uses_drafter = decoder.uses_drafter
    ranks = "batch_invariant" in decoder.option_names()
  _ENTRIES[name] = _Entry(decoder, bool(uses_drafter), bool(ranks))


def unregister(name: str) -> None:
  """Removes method `name` (a test's own decoder, say)."""
  _ENTRIES.pop(name, None)


def names() -> tuple[str, ...]:
  """Every registered method, in registration order."""
  return tuple(_ENTRIES)


def drafter_methods() -> tuple[str, ...]:
  """The methods that draft with a second model (they take drafter_params / drafter_cfg)."""
  return tuple(n for n, e in _ENTRIES.items() if e.uses_drafter)


def ranking_methods() -> tuple[str, ...]:
  """The methods that rank confidences (they take `batch_invariant`)."""
  return tuple(n for n, e in _ENTRIES.items() if e.ranks)


def check(name) -> str:
  """`name` if it is a registered method, else a ValueError listing the methods."""
  if name not in _ENTRIES:
    raise ValueError(f"Unknown decoding method {name!r}; use one of {sorted(_ENTRIES)}.")
  return name


def name_of(decoder_class) -> str:
  """The method name `decoder_class` is registered under ("" if none)."""
  path = f"{decoder_class.__module__}:{decoder_class.__qualname__}"
  return next((n for n, e in _ENTRIES.items() if e.target is decoder_class
               or e.target == path), "")


def get(name: str):
  """The decoder class of method `name` (its module is imported on first use)."""
  entry = _ENTRIES[check(name)]
  if isinstance(entry.target, str):
    module, cls = entry.target.split(":")
    entry.target = getattr(importlib.import_module(module), cls)
    entry.target.name = name
  return entry.target


# The built-in methods. Autoregressive:
register("ar", "dllm_jax.decoding.ar:ARDecoder", ranks=False)
# Masked diffusion, full-canvas forwards (LLaDA; Dream's ordering):
register("llada", "dllm_jax.decoding.llada:LLaDADecoder", ranks=True)
register("dream", "dllm_jax.decoding.llada:DreamDecoder", ranks=True)
# Fast-dLLM: threshold / factor commits, prefix / dual cache:
register("fast_dllm", "dllm_jax.decoding.fast_dllm:FastDLLMDecoder", ranks=True)
# Block-causal diffusion with an exact K/V cache: D2F's pipeline, and one block at a time:
register("d2f", "dllm_jax.decoding.d2f:D2FDecoder", ranks=True)
register("block_diffusion", "dllm_jax.decoding.d2f:BlockDiffusionDecoder", ranks=True)
# Hybrids: a drafter verified by an AR target; one network that drafts and verifies; and
# per-row switching between parallel commits, verified drafts and AR:
register("speculative", "dllm_jax.decoding.speculative:SpeculativeDecoder",
         uses_drafter=True, ranks=True)
register("selfspec", "dllm_jax.decoding.selfspec:SelfSpecDecoder",
         uses_drafter=False, ranks=False)
register("adaptive", "dllm_jax.decoding.adaptive:AdaptiveDecoder",
         uses_drafter=True, ranks=True)
