"""The lines jaxgpt itself writes to stderr, for tests that check nothing else reaches a user there
(a library's traceback, warning or notice)."""

import re

JAXGPT_LINES = [re.compile(pattern) for pattern in (
    r"note: .+",
    r"(single|pmap|sharded) on \d+ device\(s\).*",
    r"compiling the train step\.\.\.",
    r"step \d+: val loss \S+, \S+ bits/byte",
    r"step \d+: \S+/\S+ \S+(, \S+/\S+ \S+)*",  # harness tasks' metrics
    r"resuming \S+ from step \d+",
    r"no checkpoint in \S+; starting fresh",
    r"checkpoint \S+ is damaged: .+; (moved to damaged-\d+(-\d+)?|skipped), falling back to the previous one",
    r"\S+ finished at step \d+; raise train\.steps to continue",
    r"stopped at step \d+ with a checkpoint; continue with: jaxgpt train .+",
    r"jaxgpt [a-z-]+: .+",  # the command's own error, stop and launch lines
    r"(building|encoding) .+\.\.\.",  # a slow stage starting
    r"results: .+",
    r"W&B: (offline run in \S+ \(`wandb sync \S+` uploads it\)|https?://\S+)",
    r"\{.+\}",  # generate --stats
)]


def foreign_lines(stderr: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """The lines of `stderr` that are not jaxgpt's (nor match one of the `allowed` patterns)."""
    patterns = [*JAXGPT_LINES, *(re.compile(p) for p in allowed)]
    return [line for line in stderr.splitlines() if not any(p.fullmatch(line) for p in patterns)]
