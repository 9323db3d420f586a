"""The ledger of zero's collective traffic: calls, elements, bytes and seconds per kind.

Totals per optimizer step, in the units the Communicator records (communicator.py: elements per
rank in the paper's units, ZeRO section 7, and their bytes); the previous step's totals stay
readable while the next step counts. Imports nothing of zero.
"""

from dataclasses import dataclass, field


@dataclass
class OpTotals:
    """Totals for one collective kind: calls, elements (paper units), bytes per rank, and
    seconds from launch to completion (only while timing is on, see Communicator.timing).
    `inter_elements` / `inter_bytes`: the part of `elements` / `bytes` exchanged with ranks on
    other nodes ([Note: intra- and inter-node volume] in topology.py); the rest is intra-node
    (`intra_elements`, `intra_bytes`)."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0
    inter_elements: int = 0
    inter_bytes: int = 0

    @property
    def intra_elements(self) -> int:
        return self.elements - self.inter_elements

    @property
    def intra_bytes(self) -> int:
        return self.bytes - self.inter_bytes


@dataclass
class CommLedger:
    """Per-step counters of collective traffic. `last_step` holds the previous optimizer step."""

    current: dict[str, OpTotals] = field(default_factory=dict)
    last_step: dict[str, OpTotals] = field(default_factory=dict)
    # While timing is on: seconds the caller waited for each collective kind in this step (a
    # synchronous collective's whole call, an asynchronous one's launch and wait()), i.e. the
    # communication that did not overlap compute (monitor.py, [Note: step-time breakdown]).
    waited: dict[str, float] = field(default_factory=dict)
    # Elements stage 3 did not all-gather in backward because their unit stayed gathered from its
    # forward ([Note: reuse distance] in partition/gatherer.py): this step's, and the previous
    # step's.
    kept: int = 0
    last_kept: int = 0
    # Elements stage 3 all-gathered for frozen parameters (not in Psi, which counts trainable
    # ones): this step's, and the previous step's. `kept` counts trainable units' elements only.
    frozen: int = 0
    last_frozen: int = 0

    def record(
        self,
        op: str,
        elements: int,
        element_size: int,
        inter_elements: int = 0,
        nbytes: int | None = None,
        inter_bytes: int | None = None,
    ) -> None:
        """Count one collective of `elements` (paper units) of `element_size` bytes each,
        `inter_elements` of them exchanged with other nodes. `nbytes` / `inter_bytes`, when
        given, are the bytes really moved (ZeRO++'s quantized collectives, op names ending in
        "_q": `elements` counts the values they stand for, whatever their width)."""
        totals = self.current.setdefault(op, OpTotals())
        totals.calls += 1
        totals.elements += elements
        totals.bytes += elements * element_size if nbytes is None else nbytes
        totals.inter_elements += inter_elements
        totals.inter_bytes += inter_elements * element_size if inter_bytes is None else inter_bytes

    def tiers(self, step: dict | None = None) -> dict[str, int]:
        """Bytes and elements of one step's collectives (`step`: op -> OpTotals, default the
        last step) summed over ops by tier: {"intra_bytes", "inter_bytes", "intra_elements",
        "inter_elements"}."""
        step = self.last_step if step is None else step
        out = dict.fromkeys(("intra_bytes", "inter_bytes", "intra_elements", "inter_elements"), 0)
        for totals in step.values():
            for key in out:
                out[key] += getattr(totals, key)
        return out

    def add_time(self, op: str, seconds: float, waited: float = 0.0) -> None:
        """Add the launch-to-completion and the waited seconds of one collective of kind `op`."""
        self.current.setdefault(op, OpTotals()).seconds += seconds
        self.waited[op] = self.waited.get(op, 0.0) + waited

    def end_step(self) -> None:
        """Close the optimizer step: its totals move to `last_step`, counting restarts at 0."""
        self.last_step, self.current = self.current, {}
        self.last_kept, self.kept = self.kept, 0
        self.last_frozen, self.frozen = self.frozen, 0
        self.waited = {}
