"""The front doors agree: the same name means the same thing, typed and defaulted alike.

``cached_value_and_grad``, ``make_train_step``, ``chunked_encoder`` and ``GradCache``
share their settings (``GradCache`` keeps the PyTorch original's positional names:
``chunk_sizes`` for ``chunk_size``). A setting added to one and not the others, or
annotated ``int`` where a ``TokenBudget`` is taken, fails here.
"""

import inspect
import typing

import pytest

import gc_jax
from gc_jax._base import Encoder

DOORS = {
    "cached_value_and_grad": gc_jax.cached_value_and_grad,
    "make_train_step": gc_jax.make_train_step,
    "chunked_encoder": gc_jax.chunked_encoder,
    "GradCache": gc_jax.compat.GradCache.__init__,
}
ALIASES = {"chunk_sizes": "chunk_size"}  # GradCache: the original's name
# Settings every front door that trains over several inputs takes.
SHARED = ("chunk_size", "has_aux", "axis_name", "batch_axis", "cache_dtype")
SINGLE_INPUT = ("chunk_size", "batch_axis")  # chunked_encoder wraps one encoder


def params(fn) -> dict[str, inspect.Parameter]:
    found = inspect.signature(fn).parameters
    return {ALIASES.get(n, n): p for n, p in found.items() if n != "self"}


def hints(fn) -> dict:
    found = typing.get_type_hints(fn)
    return {ALIASES.get(n, n): t for n, t in found.items()}


@pytest.mark.parametrize("name", DOORS)
def test_each_front_door_takes_the_shared_settings(name):
    wanted = SINGLE_INPUT if name == "chunked_encoder" else SHARED
    missing = [s for s in wanted if s not in params(DOORS[name])]
    assert not missing, f"{name} lacks {missing}"


@pytest.mark.parametrize("setting", ["has_aux", "axis_name", "batch_axis", "cache_dtype", "policy"])
def test_a_keyword_setting_has_one_annotation_default_and_kind(setting):
    seen = {
        name: (hints(fn)[setting], params(fn)[setting].default, params(fn)[setting].kind)
        for name, fn in DOORS.items()
        if setting in params(fn)
    }
    assert seen, setting
    assert len(set(seen.values())) == 1, f"{setting} differs between front doors: {seen}"
    assert next(iter(seen.values()))[2] is inspect.Parameter.KEYWORD_ONLY, setting


@pytest.mark.parametrize("setting", ["chunk_size", "loss_fn"])
def test_a_positional_setting_has_one_annotation(setting):
    """Per input or one for all; a single-input door takes what one input takes."""
    seen = {name: hints(fn)[setting] for name, fn in DOORS.items() if setting in params(fn)}
    per_input = {a for a in seen.values() if typing.get_origin(a) is not None and any(
        typing.get_origin(x) is not None for x in typing.get_args(a))}  # fmt: skip
    one = {a for a in seen.values()} - per_input
    assert len(per_input) <= 1 and len(one) <= 1, f"{setting} differs: {seen}"
    if per_input and one:  # int | TokenBudget | Sequence[int | TokenBudget]
        (whole,), (single,) = per_input, one
        assert set(typing.get_args(single)) < set(typing.get_args(whole)), seen


def test_chunk_size_takes_a_token_budget_everywhere():
    for name, fn in DOORS.items():
        annotation = hints(fn)["chunk_size"]
        assert gc_jax.TokenBudget in typing.get_args(annotation) or any(
            gc_jax.TokenBudget in typing.get_args(a) for a in typing.get_args(annotation)
        ), f"{name}: chunk_size is annotated {annotation}, without TokenBudget"


def test_encoders_are_typed_as_encoders():
    assert hints(gc_jax.chunked_encoder)["encode"] == Encoder
    for name in ("cached_value_and_grad", "make_train_step"):
        assert Encoder in typing.get_args(hints(DOORS[name])["encoders"]), name
