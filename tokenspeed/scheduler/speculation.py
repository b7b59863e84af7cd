"""Speculative decoding on the scheduler's side: who drafts how many tokens, and what it earned.

Each step, after every running decode row has its one token (drafts never
push a decode row out), `Speculation.plan_drafts` gives decode rows drafts,
oldest first, while the step's token budget lasts: a draft token counts
against `max_num_batched_tokens` like any other. A row's draft length is

* its adaptive length (below), at most `num_speculative_tokens`;
* at most what its `max_tokens` leaves after the bonus token (so every
  emitted token fits, and so do the positions, below `max_model_len`);
* at most what free pages hold: draft pages come from the free list only,
  never by evicting cached prefix pages or preempting anyone;
* for a host drafter, what it proposes (often nothing: no match), and zero
  when the request's last token is an unresolved overlap placeholder (the
  drafter cannot see it); a device drafter reads that token on the device.

No drafts at all in a step with `disable_by_batch_size` decode rows or more.

The step as a whole must pay too (adaptive only). On a GPU the verify step
pads every row to the same length (`verify_pad_length`, k_max: one CUDA
graph serves every draft length), so each of the R rows pays for k_max
draft positions, those that draft little or nothing included: the step
drafts only when its expected tokens, sum over rows of 1 + a + ... + a^k
(a row without drafts: 1), exceed R * (1 + c * f * k_max). f is the step's
fill of the largest verify graph, R * (k_max + 1) / `max_verify_tokens`: a
small step is launch- and memory-bound (its extra positions nearly free, so
one user at bs1 still drafts 15), a full one pays c per position (c: the
cost measured at a full graph). When R * (k_max + 1) exceeds the largest
verify graph the step would run eagerly at many times a decode step's cost:
no drafts. Without graphs (`enforce_eager`) the executor reports the graphs'
bounds all the same, so graphs on and off plan the same steps. Host
drafts are proposed before the step gate and pages are allocated after it,
so a step that does not pay allocates nothing.

Adaptive length: acceptance of a request's drafts is modelled as
independent per position with rate a, estimated from its recent verify rows
(exponentially decayed counts of accepted positions over verified positions:
accepted drafts, plus the first rejected one). Drafting k then yields
1 + a + ... + a^k tokens per step for a cost of 1 + c*k (c =
`draft_token_cost`, one draft position's cost relative to a decode row), and
the length maximising their ratio is taken, down to 0 when drafting does not
pay. A request held at 0 probes with one draft every `probe_interval` steps
so its estimate can recover. `adaptive=False` always drafts the maximum (the
off switch, of the step pricing below too).

Metrics (`SpeculationStats`): drafts, draft tokens, accepted tokens,
acceptance rate, mean accepted length and acceptance per position, counted
from the verifier's results (before stop conditions cut them).

Torch-free (mypy --strict with the rest of the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenspeed.kvcache import KVCache
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID
from tokenspeed.scheduler.request import Request

if TYPE_CHECKING:
    from tokenspeed.scheduler.drafter import Drafter

_PRIOR_RATE = 0.7  # acceptance assumed for a request with no history yet
_PRIOR_WEIGHT = 2.0  # in verified positions


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """What the scheduler needs of `speculative_config` (built by `spec.config.SpeculativeConfig`)."""

    method: str  # "ngram" | "suffix" | "mtp" | "eagle" | "eagle3" | "draft_model"
    num_speculative_tokens: int  # k, the most drafts per row
    on_device: bool  # the executor drafts (EAGLE, MTP, draft model); else a host `Drafter` does
    adaptive: bool = True
    draft_token_cost: float = 0.1
    disable_by_batch_size: int | None = None
    probe_interval: int = 16
    decay: float = 0.8  # weight of a request's older acceptance history per verify row
    verify_pad_length: int | None = None  # the executor pads verify rows to this many drafts (None: no padding)
    max_verify_tokens: int | None = None  # the largest verify step the executor runs as a graph (None: no limit)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not self.draft_token_cost >= 0.0:
            raise ValueError(f"draft_token_cost must be >= 0, got {self.draft_token_cost}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")


@dataclass(slots=True)
class DraftState:
    """One request's recent acceptance (decayed counts of verified draft positions)."""

    accepted: float = _PRIOR_RATE * _PRIOR_WEIGHT
    verified: float = _PRIOR_WEIGHT
    idle_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.verified


@dataclass(slots=True)
class SpeculationStats:
    """Counters of one drafter, for `/metrics` and benchmark results."""

    method: str
    num_drafts: int = 0  # verify rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # drafts accepted at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify row: accepted drafts plus the model's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass(slots=True)
class RowDrafts:
    """What one decode row verifies: k drafts, given (host) or to be drafted by the executor."""

    num_draft_tokens: int
    draft_token_ids: list[int]


class Speculation:
    def __init__(self, policy: DraftPolicy, drafter: Drafter | None) -> None:
        if policy.on_device != (drafter is None):
            raise ValueError(
                f"method {policy.method!r} drafts {'on the device' if policy.on_device else 'on the host'}: "
                f"{'no host drafter may be given' if policy.on_device else 'a host drafter is needed'}"
            )
        self.policy = policy
        self.drafter = drafter
        self.stats = SpeculationStats(policy.method, accepted_per_position=[0] * policy.num_speculative_tokens)

    def plan_drafts(self, decoders: list[Request], budget: int, kv: KVCache) -> tuple[dict[int, RowDrafts], int]:
        """Drafts for the step's decode rows (by id() of the request) and the budget they use.

        Allocates the pages of the draft positions; the rows' one input token already has its page.
        """
        policy = self.policy
        planned: dict[int, RowDrafts] = {}
        used = 0
        rows = len(decoders)
        if not self.may_draft(rows):
            return planned, used
        wanted: list[tuple[Request, int]] = []
        for request in decoders:
            if not policy.on_device and request.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                continue
            if policy.on_device and request.sampling.needs_grammar:
                continue  # the host never sees device drafts, so it cannot mask them by the grammar
            remaining = request.max_output_tokens - len(request.output_token_ids)
            k = min(self.draft_length(request), remaining - 1)
            if k > 0:
                wanted.append((request, k))
        if not self._step_pays(rows, wanted):  # even the longest drafts would not pay: propose nothing
            return planned, used
        proposed: list[tuple[Request, list[int], int]] = []
        for request, k in wanted:
            if used >= budget:
                break
            k = min(k, budget - used)
            drafts: list[int] = []
            if self.drafter is not None:
                drafts = self.drafter.propose(request.request_id, request.prompt_token_ids,
                                              request.output_token_ids, k)[:k]
                k = len(drafts)
                if k == 0:
                    continue
            proposed.append((request, drafts, k))
            used += k
        if not self._step_pays(rows, [(request, k) for request, _, k in proposed]):
            return {}, 0
        used = 0
        for request, drafts, k in proposed:
            k = min(k, _fits_in_free_pages(request, k, kv))
            if k <= 0:
                continue
            grow = kv.pages_for(request.num_computed_tokens + 1 + k) - len(request.table)
            if grow > 0:
                kv.allocate(request.table, grow)
            planned[id(request)] = RowDrafts(k, drafts[:k])
            used += k
        return planned, used

    def may_draft(self, rows: int, running: Sequence[Request] | None = None) -> bool:
        """Whether a step of `rows` decode rows may carry drafts at all: below `disable_by_batch_size`, its
        padded verify step within the largest verify graph and, given the `running` requests, paying as a
        whole with each one's adaptive length (module docstring; adaptive only).

        Called once a step with `running` (the engine core keeps a step overlapped when it says no, and a
        host drafter then sees no resolved tokens): a request held at 0 counts that step towards its probe,
        as `draft_length` would have."""
        policy = self.policy
        if policy.disable_by_batch_size is not None and rows >= policy.disable_by_batch_size:
            return False
        if not policy.adaptive:
            return True
        pad = policy.verify_pad_length
        if pad is None:
            return True
        if policy.max_verify_tokens is not None and rows * (pad + 1) > policy.max_verify_tokens:
            return False
        if running is None:
            return True
        wanted: list[tuple[Request, int]] = []
        held: list[DraftState] = []
        for request in running:
            state = _state(request)
            k = self._best_length(state)
            if k == 0 and state.idle_steps + 1 >= policy.probe_interval:
                k = 1  # due to probe: let `draft_length` do it
            if k == 0:
                held.append(state)
            else:
                wanted.append((request, k))
        if self._step_pays(rows, wanted):
            return True
        for state in held:
            state.idle_steps += 1
        return False

    def _step_pays(self, rows: int, drafted: Sequence[tuple[Request, int]]) -> bool:
        """Whether a step of `rows` decode rows, these drafting k each, beats a plain decode step: expected
        tokens against the step's cost, every row padded to `verify_pad_length` (module docstring). Unpadded
        rows pay for their own drafts only, which each row's adaptive length already weighed."""
        policy = self.policy
        if not drafted:
            return False
        if not policy.adaptive or policy.verify_pad_length is None:
            return True
        pad = max(policy.verify_pad_length, max(k for _, k in drafted))
        fill = 1.0 if policy.max_verify_tokens is None else min(1.0, rows * (pad + 1) / policy.max_verify_tokens)
        expected = rows - len(drafted) + sum(_expected_tokens(_state(r).acceptance, k) for r, k in drafted)
        return expected > rows * (1.0 + policy.draft_token_cost * fill * pad)

    def draft_length(self, request: Request) -> int:
        """The adaptive draft length of `request` (module docstring)."""
        policy = self.policy
        if not policy.adaptive:
            return policy.num_speculative_tokens
        state = _state(request)
        best = self._best_length(state)
        if best == 0:
            state.idle_steps += 1
            if state.idle_steps >= policy.probe_interval:
                state.idle_steps = 0
                return 1
        return best

    def _best_length(self, state: DraftState) -> int:
        """The k maximising (1 + a + ... + a^k) / (1 + c k) for the state's acceptance a (0: none pays)."""
        policy = self.policy
        rate, cost = state.acceptance, policy.draft_token_cost
        best, best_ratio = 0, 1.0
        expected, reach = 1.0, 1.0
        for k in range(1, policy.num_speculative_tokens + 1):
            reach *= rate
            expected += reach
            ratio = expected / (1.0 + cost * k)
            if ratio > best_ratio * (1.0 + 1e-9):
                best, best_ratio = k, ratio
        return best

    def record(self, request: Request, num_draft_tokens: int, num_emitted: int) -> None:
        """A verify row of `request` drafted `num_draft_tokens` and emitted `num_emitted` tokens."""
        accepted = num_emitted - 1
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += accepted
        for position in range(accepted):
            stats.accepted_per_position[position] += 1
        state = _state(request)
        decay = self.policy.decay
        state.accepted = decay * state.accepted + accepted
        state.verified = decay * state.verified + accepted + (1 if accepted < num_draft_tokens else 0)
        state.idle_steps = 0

    def release(self, request: Request) -> None:
        """The request left (finished or aborted): the drafter may learn from its known tokens."""
        if self.drafter is not None:
            outputs: Sequence[int] = request.output_token_ids
            if outputs and outputs[-1] == PLACEHOLDER_TOKEN_ID:
                outputs = outputs[:-1]
            self.drafter.release(request.request_id, request.prompt_token_ids, outputs)


def _state(request: Request) -> DraftState:
    if request.draft_state is None:
        request.draft_state = DraftState()
    return request.draft_state


def _expected_tokens(rate: float, k: int) -> float:
    """1 + a + ... + a^k: tokens a verify row of k drafts emits, acceptance independent per position at rate a."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def _fits_in_free_pages(request: Request, k: int, kv: KVCache) -> int:
    """The most drafts (<= k) whose positions the request's pages plus the free pages hold."""
    capacity = (len(request.table) + kv.pool.num_free) * kv.page_size
    return min(k, capacity - (request.num_computed_tokens + 1))
