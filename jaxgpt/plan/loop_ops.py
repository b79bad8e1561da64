"""What one iteration of a compiled program's outer loop runs: read from its optimised HLO text.

The sampler's decode program (`decode.hlo.txt` of `jaxgpt dry-run --hlo`) is one `while` loop, an
iteration a token (at batch 1, greedy or sampled). `loop_ops` counts the ops such an iteration
launches on the device and lists those that write a large tensor other than in place:

    found = loop_ops(Path("decode.hlo.txt").read_text())
    found["launches"]      # kernel-launching ops an iteration (a nested loop's body times its trips)
    found["large_writes"]  # [{"op", "root", "shape", "elements", "times"}]: outputs of 2**20 elements or more

An op launches unless it is bookkeeping the compiler resolves without a kernel (parameters,
tuples, bitcasts, constants). A nested `while` counts its condition and body once per trip (its
trip count as the compiler knows it, else 1); a `conditional` counts its cheapest branch, the
one an iteration usually takes (the sampler's slide branch runs once in `context_length // 2`
tokens). A write is in place when the op is a dynamic-update-slice or scatter, or a fusion
whose result is one: those write their update into the buffer they were given; so does a
custom call's output aliased to one of its operands (`output_to_operand_aliasing`: a Pallas
kernel that writes the KV cache it was handed).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

LARGE = 2**20
# Ops that launch no kernel: they name, group or reinterpret buffers.
BOOKKEEPING = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
                         "after-all", "add-dependency", "partition-id", "replica-id", "domain"})
IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})

_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|f16|bf16|f32|f64|c64|c128|token)"
                    r"\[([\d,]*)\]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# A custom call's aliases, `{{1}: (6, {}), {2}: (7, {})}`: each output's index and the operand it aliases.
_ALIAS = r"\{([\d,]*)\}: \(\d+, \{[\d,]*\}\)"
_ALIASES = re.compile(rf"output_to_operand_aliasing=\{{((?:{_ALIAS}(?:, )?)*)\}}")


@dataclass
class Instruction:
    name: str
    opcode: str
    shape: str
    attributes: str
    root: bool


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions if i.root)


def _split_shape(rest: str) -> tuple[str, str]:
    """(the result shape, what follows it) of an instruction's right-hand side."""
    if rest.startswith("("):
        depth = 0
        for at, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return rest[:at + 1], rest[at + 1:].lstrip()
    shape, _, after = rest.partition(" ")
    return shape, after


def parse(text: str) -> tuple[dict[str, Computation], str]:
    """The module's computations by name, and the entry computation's name."""
    computations: dict[str, Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(2), Computation(header.group(2)))
                entry = header.group(2) if header.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if found:
            shape, after = _split_shape(found.group(3))
            opcode, _, attributes = after.partition("(")
            current.instructions.append(Instruction(found.group(2), opcode.strip(), shape, attributes,
                                                    bool(found.group(1))))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _called(instruction: Instruction, key: str) -> str | None:
    found = re.search(rf"\b{key}=%([\w.\-]+)", instruction.attributes)
    return found.group(1) if found else None


def _branches(instruction: Instruction) -> list[str]:
    listed = re.search(r"branch_computations=\{([^}]*)\}", instruction.attributes)
    if listed:
        return [name.strip().lstrip("%") for name in listed.group(1).split(",")]
    return [name for name in (_called(instruction, "true_computation"), _called(instruction, "false_computation")) if name]


def elements(shape: str) -> list[int]:
    """The element count of each array in a (possibly tuple) shape."""
    return [math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape)]


def _root(instruction: Instruction, computations: dict[str, Computation]) -> str:
    """What an op computes last: a fusion's root opcode, else its own."""
    called = computations.get(_called(instruction, "calls") or "") if instruction.opcode == "fusion" else None
    return instruction.opcode if called is None else called.root.opcode


def _writes_in_place(instruction: Instruction, computations: dict[str, Computation]) -> bool:
    if instruction.opcode in IN_PLACE:
        return True
    if instruction.opcode != "fusion":
        return False
    called = computations.get(_called(instruction, "calls") or "")
    if called is None:
        return False
    by_name = {i.name: i for i in called.instructions}

    def in_place(one: Instruction) -> bool:
        if one.opcode in IN_PLACE:
            return True
        if one.opcode in ("bitcast", "tuple"):
            operands = re.findall(r"%([\w.\-]+)", one.attributes.split(")")[0])
            return bool(operands) and all(in_place(by_name[o]) if o in by_name else False for o in operands)
        return False

    return in_place(called.root)


def _written(instruction: Instruction) -> list[int]:
    """The element count of each output an op writes anew: all but a custom call's outputs that
    alias an operand (an array output's index is empty, a tuple's i-th output's is i)."""
    counts = elements(instruction.shape)
    listed = _ALIASES.search(instruction.attributes) if instruction.opcode == "custom-call" else None
    if listed is None:
        return counts
    aliased = set(re.findall(_ALIAS, listed.group(1)))
    if "" in aliased:
        return []
    return [count for at, count in enumerate(counts) if str(at) not in aliased]


@dataclass
class Tally:
    launches: float = 0
    large_writes: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def add(self, other: Tally, times: float) -> None:
        self.launches += other.launches * times
        for key, write in other.large_writes.items():
            mine = self.large_writes.setdefault(key, {**write, "times": 0})
            mine["times"] += write["times"] * times


def _tally(name: str, computations: dict[str, Computation], large: int) -> Tally:
    tally = Tally()
    for instruction in computations[name].instructions:
        op = instruction.opcode
        if op in BOOKKEEPING:
            continue
        if op == "while":
            trips = _TRIPS.search(instruction.attributes)
            n = int(trips.group(1)) if trips else 1
            tally.add(_tally(_called(instruction, "body"), computations, large), n)
            tally.add(_tally(_called(instruction, "condition"), computations, large), n + 1 if trips is None else 0)
            continue
        if op == "conditional":
            tallies = [_tally(branch, computations, large) for branch in _branches(instruction)]
            tally.launches += 1  # the predicate's read
            tally.add(min(tallies, key=lambda t: (t.launches, len(t.large_writes))), 1)
            continue
        if op == "call":
            tally.add(_tally(_called(instruction, "to_apply"), computations, large), 1)
            continue
        tally.launches += 1
        largest = max(_written(instruction), default=0)
        if largest >= large and not _writes_in_place(instruction, computations):
            tally.large_writes[(op, instruction.name)] = {
                "op": f"{op} {instruction.name}", "root": _root(instruction, computations), "shape": instruction.shape,
                "elements": largest, "times": 1}
    return tally


def loop_ops(text: str, large: int = LARGE) -> dict[str, Any]:
    """One iteration of the entry computation's outermost `while` loop (the token loop of a decode
    program): its launching ops and its writes of `large` elements or more that are not in place
    (module docstring), with the conditionals it holds (`conditionals`)."""
    computations, entry = parse(text)
    loops = [i for i in computations[entry].instructions if i.opcode == "while"]
    if not loops:
        raise ValueError("the entry computation has no while loop")
    loop = max(loops, key=lambda i: len(computations[_called(i, "body")].instructions))
    tally = _tally(_called(loop, "body"), computations, large)
    tally.add(_tally(_called(loop, "condition"), computations, large), 1)
    writes = sorted(tally.large_writes.values(), key=lambda w: -w["elements"] * w["times"])
    conditionals = sum(i.opcode == "conditional" for i in computations[_called(loop, "body")].instructions)
    return {"launches": round(tally.launches), "large_writes": writes, "conditionals": conditionals}
