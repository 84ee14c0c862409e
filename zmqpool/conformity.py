"""Replies held to the specs their env registered, once per layout, before anything is stacked.

A reply whose leaf has another shape than its env's spec says (an
observation of ``[5]`` where the spec says ``[4]``) would make the stack of a
whole batch fail, losing every env's result and naming none. Each env gets a
:class:`ReplyCheck` when it registers: a reply whose layout contradicts the
env's observation, reward or done specs becomes an
:class:`~zmqpool.errors.EnvError` for that env, naming the leaf; the other
envs' replies are untouched.

Leaves the specs do not declare are not checked (an env may return more than
it declares), nor are dims a spec leaves dynamic (``-1``), nor heterogeneous
(lazily stacked) layouts.
"""

from __future__ import annotations

from typing import Any

from zmqpool.layout import Key, Layout

#: Layouts judged per env before the cache starts afresh (a decoder holds at most 256).
_MAX_VERDICTS = 1024
#: The output specs whose leaves a reply carries at their spec's shape.
_OUTPUT_SPECS = ("full_observation_spec", "full_reward_spec", "full_done_spec")


def expected_shapes(spec: Any) -> dict[Key, tuple[int, ...]]:
    """Each declared output leaf's key and shape (an env's ``specs``); {} if it cannot tell."""
    try:
        output = spec["output_spec"]
        shapes: dict[Key, tuple[int, ...]] = {}
        for name in _OUTPUT_SPECS:
            if name not in output:
                continue
            for key, leaf in output[name].items(include_nested=True, leaves_only=True):
                key = (key,) if isinstance(key, str) else tuple(key)
                shapes[key] = tuple(int(d) for d in leaf.shape)
        return shapes
    except Exception:  # a stacked (heterogeneous) spec and the like: nothing to hold it to
        return {}


class ReplyCheck:
    """One env's check of the layouts its replies come in, each layout judged once."""

    def __init__(self, env: int, spec: Any) -> None:
        self.env = env
        self.shapes = expected_shapes(spec)
        # Keyed by identity (layouts are interned; the layout is kept so its id stays its own).
        self._verdicts: dict[int, tuple[Layout, str | None]] = {}

    def __call__(self, layout: Layout) -> str | None:
        """What is wrong with a reply in ``layout``, or None."""
        known = self._verdicts.get(id(layout))
        if known is None:
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            known = self._verdicts[id(layout)] = (layout, self._judge(layout))
        return known[1]

    def _judge(self, layout: Layout) -> str | None:
        if layout.lazy or not self.shapes:
            return None
        for leaf in layout.leaves:
            want = self.shapes.get(leaf.key)
            if want is not None and not _fits(leaf.shape, want):
                return (
                    f"env {self.env} replied with {'/'.join(leaf.key)} of shape "
                    f"{list(leaf.shape)}; its spec says {list(want)}"
                )
        return None


def _fits(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    if len(shape) != len(want):
        return False
    return all(w < 0 or s == w for s, w in zip(shape, want, strict=True))
