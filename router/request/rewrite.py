"""Model-name rewrites: the name a client asked for → the name the engines are to serve it under.

How traffic is split between model versions or LoRA adapters behind one public name (the
Inference Extension's ``InferenceModelRewrite``): a rule maps one requested name to weighted
targets, chosen at random per request; a gateway (an HTTPRoute header filter) can instead name
the target in ``x-gateway-model-name-rewrite`` (llm-d: ``x-llm-d-model-name-rewrite``), which
wins over the rules. The rewritten name is what the body sent upstream carries and what the
request is routed and counted for; the requested one stays the series' ``model_name``.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

REWRITE_HEADERS = ("x-gateway-model-name-rewrite", "x-llm-d-model-name-rewrite")
HEADER_RULE = "header"  # the rule name a header-driven rewrite is counted under
MAX_MODEL_NAME = 256  # a header naming a longer model is refused, not forwarded


@dataclass(frozen=True, slots=True)
class Rewrite:
    rule: str  # the rule's name, or HEADER_RULE
    requested: str
    target: str


@dataclass(frozen=True, slots=True)
class RewriteRule:
    name: str
    targets: tuple[str, ...]
    cumulative: tuple[float, ...]  # running sum of the targets' weights


class ModelRewrites:
    """The rules by requested name, plus at most one rule for any model; ``choose`` picks one
    request's target."""

    def __init__(
        self,
        rules: Sequence[tuple[str, str | None, Sequence[tuple[str, float]]]],
        rng: random.Random | None = None,
    ) -> None:
        """``rules``: (rule name, requested model or None for any model, [(target model, weight),
        ...]) each, in precedence order: the first rule for a name wins, and a rule for any model
        applies only to names no rule names."""
        self.rules: dict[str, RewriteRule] = {}
        self.any_model: RewriteRule | None = None
        for name, requested, targets in rules:
            weights = [weight for _, weight in targets]
            rule = RewriteRule(
                name, tuple(target for target, _ in targets), tuple(itertools.accumulate(weights))
            )
            if requested is None:
                self.any_model = self.any_model or rule
            else:
                self.rules.setdefault(requested, rule)
        every_rule = (*self.rules.values(), *((self.any_model,) if self.any_model else ()))
        self.targets = frozenset(t for rule in every_rule for t in rule.targets)
        self._random = (rng or random.Random()).random

    def choose(self, requested: str, headers: Mapping[str, str]) -> Rewrite | None:
        """The rewrite for a request of ``requested`` with these headers, or None to keep it.

        Raises ``ValueError`` for a rewrite header that cannot be a model name."""
        for header in REWRITE_HEADERS:
            named = headers.get(header)
            if named is not None:
                target = named.strip()
                if not target or len(target) > MAX_MODEL_NAME:
                    raise ValueError(f"{header} must name a model (1 to {MAX_MODEL_NAME} characters)")
                return None if target == requested else Rewrite(HEADER_RULE, requested, target)
        rule = self.rules.get(requested, self.any_model)
        if rule is None:
            return None
        total = rule.cumulative[-1]
        index = bisect.bisect_right(rule.cumulative, self._random() * total)
        target = rule.targets[min(index, len(rule.targets) - 1)]
        return None if target == requested else Rewrite(rule.name, requested, target)
