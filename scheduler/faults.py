"""Fault injection for tests and drills: make a real server fail on a chosen request or step.

The plan is a comma-separated list of rules, set with `EngineConfig.fault_injection` or the
`PAGESTREAM_FAULT_INJECTION` environment variable (so a `pagestream serve` subprocess can
be told to fail).  Requests are picked by a marker token id in their prompt, which a
client controls (a completions prompt given as token ids):

- `sample-token=ID[@K]`   sampling fails for a request whose prompt holds ID, when it
                           samples its K-th output token (K defaults to 0, the first);
- `register-token=ID`     the runner fails to take such a request on (its first step);
- `detok-token=ID[@K]`    the service's output processing (detokenizer / stop strings)
                           fails on such a request's K-th output token;
- `forward-token=ID`      the forward pass raises for the whole batch when such a request
                           is scheduled: an engine failure;
- `step=N`                the forward pass raises at step N: an engine failure.

Request-scoped rules must fail only their request; engine-scoped ones end the engine.
The checks sit inside the real code paths (the runner's registration and its batched
sampler, the service's output processing), so the isolation under test is the real one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler import envs

ENV_VAR = "PAGESTREAM_FAULT_INJECTION"
_KINDS = ("sample-token", "register-token", "detok-token", "forward-token", "step")


class InjectedFault(RuntimeError):
    """Raised where a fault-injection rule says so."""


@dataclass(frozen=True)
class FaultPlan:
    sample: dict[int, int] = field(default_factory=dict)  # marker token -> output index
    register: frozenset[int] = frozenset()
    detok: dict[int, int] = field(default_factory=dict)
    forward: frozenset[int] = frozenset()
    steps: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan | None:
        """None for an empty spec; ValueError naming the rule for a malformed one."""
        if not spec or not spec.strip():
            return None
        sample: dict[int, int] = {}
        detok: dict[int, int] = {}
        register: set[int] = set()
        forward: set[int] = set()
        steps: set[int] = set()
        for rule in (r.strip() for r in spec.split(",")):
            if not rule:
                continue
            kind, _, value = rule.partition("=")
            if kind not in _KINDS or not value:
                raise ValueError(f"bad fault-injection rule {rule!r}; kinds: {', '.join(_KINDS)}")
            try:
                tok, _, at = value.partition("@")
                num, k = int(tok), int(at or 0)
            except ValueError:
                raise ValueError(f"bad fault-injection rule {rule!r}: not an integer") from None
            if kind == "sample-token":
                sample[num] = k
            elif kind == "detok-token":
                detok[num] = k
            elif kind == "register-token":
                register.add(num)
            elif kind == "forward-token":
                forward.add(num)
            else:
                steps.add(num)
        return cls(sample, frozenset(register), detok, frozenset(forward), frozenset(steps))

    @classmethod
    def from_env(cls, spec: str | None = None) -> FaultPlan | None:
        return cls.parse(spec if spec is not None else envs.PAGESTREAM_FAULT_INJECTION)

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _marked(markers: object, prompt: Sequence[int]) -> int | None:
        return next((t for t in prompt if t in markers), None)  # type: ignore[operator]

    def check_register(self, req_id: str, prompt: Sequence[int]) -> None:
        if self.register and self._marked(self.register, prompt) is not None:
            raise InjectedFault(f"injected registration fault for {req_id}")

    def check_sample(self, req_id: str, prompt: Sequence[int], num_output: int) -> None:
        if self.sample:
            t = self._marked(self.sample, prompt)
            if t is not None and self.sample[t] == num_output:
                raise InjectedFault(f"injected sampling fault for {req_id} at token {num_output}")

    def check_detok(self, req_id: str, prompt: Sequence[int], num_output: int) -> None:
        if self.detok:
            t = self._marked(self.detok, prompt)
            if t is not None and self.detok[t] == num_output:
                raise InjectedFault(
                    f"injected output-processing fault for {req_id} at token {num_output}"
                )

    def check_forward(self, step: int, prompts: Sequence[Sequence[int]]) -> None:
        if step in self.steps:
            raise InjectedFault(f"injected engine fault at step {step}")
        if self.forward and any(self._marked(self.forward, p) is not None for p in prompts):
            raise InjectedFault(f"injected engine fault at step {step} (marked request)")
