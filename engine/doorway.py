"""Whether this process came in through the doorway: a program written for DeepSpeed imported
`deepspeed` and got zero (zero-as-deepspeed; zero.integrations.deepspeed.install() records it).

The rule (docs/migrating-from-deepspeed.md, "What the doorway promises"): under the doorway zero
behaves as DeepSpeed 0.19.8 does wherever a program can observe it, and says once, loudly, what
is unsafe; programs that `import zero` keep zero's strictness. The places that differ read
entered() when their engine is built.
"""

_entered = False


def enter() -> None:
    """Record that `deepspeed` is zero's in this process (called once the doorway's module is
    installed). Not a collective."""
    global _entered
    _entered = True


def entered() -> bool:
    """True once a program imported `deepspeed` through the doorway in this process."""
    return _entered
