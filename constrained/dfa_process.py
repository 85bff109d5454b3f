"""outlines-core's byte DFA of a regex, built in helper processes that a deadline can stop.

outlines-core determinizes a regex in one native call that checks no size limit and cannot be
interrupted: `[ab]*a[ab]{30}` needs 2**31 states, so that call would run for hours with its memory
growing all the while, and a thread that made it would be lost until then. So a compile worker
never makes the call itself: it sends the regex to a helper process (started on first use, kept
between builds) and waits for the answer until the compile's deadline (pushed later while other
callers join the same compile). A helper still building then is killed, which gives the worker and
the memory back at once.

The helper also refuses a DFA of more than `max_states` states instead of sending it back.
outlines-core shows the states only once its build is done, so this cap bounds what a compiled
grammar holds (its transition table, and the memory renumbering that table takes), while the
deadline bounds how long a build may run.

This module is also the helper's program (`python -I dfa_process.py`), so at the top level it imports
only the standard library: a helper starts in ~40 ms and never loads numpy or torch. `build_dfa` is
the build itself, which the helper runs and which runs in-process too, as the plain twin.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from array import array
from functools import cache
from itertools import chain
from typing import IO, Any, NamedTuple

_LENGTH = struct.Struct("<Q")  # each message: its length, then a pickle
# Python keeps the memory a large build freed, so a helper whose peak passed this exits after
# answering and the next build starts a fresh one.
_RETIRE_PEAK_KIB = 512 << 10
_PARENT_CHECK_S = 0.5


class RawDfa(NamedTuple):
    """outlines-core's DFA over the 256 single bytes, in its own state ids, as `array("I")`s
    (what `numpy.frombuffer(a, dtype=numpy.uintc)` reads without a copy)."""

    initial: int
    finals: array  # (F,) the accepting states
    states: array  # (n,) every state
    counts: array  # (n,) the number of transitions out of each state, in `states` order
    keys: array  # (T,) each transition's byte (256: the EOS pseudo-token of accepting states)
    targets: array  # (T,) each transition's target state


class Deadline:
    """When a build stops waiting (a time.monotonic() value). Callers who join a running build
    push it later; once a build has seen it pass, it can no longer move, and `extend` says so."""

    def __init__(self, at: float) -> None:
        self._at = at
        self._passed = False
        self._lock = threading.Lock()

    def extend(self, at: float) -> bool:
        with self._lock:
            if not self._passed:
                self._at = max(self._at, at)
            return not self._passed

    def remaining(self) -> float:
        """Seconds left; at zero or less the deadline has passed for good."""
        with self._lock:
            left = self._at - time.monotonic()
            self._passed = self._passed or left <= 0
            return left


class TooManyStates(Exception):
    """The DFA has more states than the cap allows."""

    def __init__(self, n_states: int) -> None:
        super().__init__(f"{n_states} states")
        self.n_states = n_states


class DfaRefused(Exception):
    """outlines-core refused the regex; the message is the first line of its own."""


class BuildStopped(Exception):
    """The build did not finish: its deadline passed, or its helper died or was closed."""


@cache
def _byte_vocabulary() -> Any:
    """An outlines-core Vocabulary of the 256 single bytes (token id = byte value)."""
    from outlines_core import Vocabulary

    return Vocabulary(256, {bytes([b]): [b] for b in range(256)})


# Put in front of every regex: outlines-core's builder also makes the DFA's unanchored start
# (a match may begin anywhere), and there a bounded repetition that can hold its own opening
# character (a JSON string of maxLength n holds escaped quotes) needs a subset of counts for every
# place a match might have begun: exponential in n (maxLength 20 took 76 s for 167 states). A
# character that occurs nowhere else can begin a match in one place only, which makes that part
# linear; the anchored DFA wanted starts after it. Plane 16 is never generated (regex_text.py),
# and this is not the end sentinel U+10FFFF.
START_MARK = "\U0010fffe"
_START_MARK_BYTES = START_MARK.encode()


def build_dfa(regex: str, max_states: int) -> RawDfa:
    """The DFA of `regex` over single bytes, in this process; TooManyStates past `max_states`."""
    from outlines_core import Index

    index = Index(f"{START_MARK}(?:{regex})", _byte_vocabulary())
    transitions: dict[int, dict[int, int]] = index.get_transitions()
    if len(transitions) > max_states:
        raise TooManyStates(len(transitions))
    initial = index.get_initial_state()
    for byte in _START_MARK_BYTES:  # the state after the mark: where the regex itself starts
        initial = transitions.get(initial, {}).get(byte)
        if initial is None:
            raise DfaRefused("the regex matches no text")
    rows = transitions.values()
    return RawDfa(
        initial=initial,
        finals=array("I", index.get_final_states()),
        states=array("I", transitions.keys()),
        counts=array("I", map(len, rows)),
        keys=array("I", chain.from_iterable(rows)),
        targets=array("I", chain.from_iterable(map(dict.values, rows))),
    )


class DfaBuilders:
    """The helper processes of one compiler: one per build running at a time, kept while idle.

    `build` is called from the compiler's worker threads. `close` ends every helper, and a build
    waiting on one fails with BuildStopped; helpers left over when the builders are garbage
    collected, or at exit, are ended too. A forked child must make its own DfaBuilders: the
    helpers belong to the process that started them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[subprocess.Popen] = []
        self._live: set[subprocess.Popen] = set()
        self._closed = False
        weakref.finalize(self, _end_all, self._live, os.getpid())

    def build(self, regex: str, max_states: int, deadline: Deadline) -> RawDfa:
        """The DFA of `regex` (see build_dfa), or BuildStopped once `deadline` passes; DfaRefused
        or TooManyStates as build_dfa raises them."""
        helper = self._take()
        try:
            _send(helper.stdin, (regex, max_states))  # type: ignore[arg-type]
            reply = _receive(helper.stdout.fileno(), deadline)  # type: ignore[union-attr]
        except (OSError, EOFError):
            self._end(helper)
            raise BuildStopped(
                "the compiler was closed" if self._closed else _exit_reason(helper)
            ) from None
        if reply is None:
            self._end(helper)
            raise BuildStopped("the deadline passed")
        status, value, retire = reply
        if retire:
            self._end(helper)
        else:
            self._give_back(helper)
        if status == "too_many_states":
            raise TooManyStates(value)
        if status == "refused":
            raise DfaRefused(value)
        return RawDfa(*value)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, busy = self._idle, self._live.difference(self._idle)
            self._idle = []
            self._live.difference_update(idle)
        for helper in idle:
            _end(helper)
        for helper in busy:  # its build sees the pipe close and cleans up after it
            with contextlib.suppress(OSError):
                helper.kill()

    def _take(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise BuildStopped("the compiler was closed")
            if self._idle:
                return self._idle.pop()
            helper = _start_helper()
            self._live.add(helper)
            return helper

    def _give_back(self, helper: subprocess.Popen) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(helper)
                return
        self._end(helper)

    def _end(self, helper: subprocess.Popen) -> None:
        _end(helper)
        with self._lock:
            self._live.discard(helper)


# -- the parent's side of the pipe ---------------------------------------------------------------


def _start_helper() -> subprocess.Popen:
    # -I keeps the helper's own folder (constrained/) and the environment out of its sys.path;
    # the parent's path is passed along so that it imports the same outlines-core.
    return subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), os.pathsep.join(sys.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def _end(helper: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        helper.kill()
    helper.wait()
    for pipe in (helper.stdin, helper.stdout):
        with contextlib.suppress(OSError):
            pipe.close()  # type: ignore[union-attr]


def _end_all(helpers: set[subprocess.Popen], pid: int) -> None:
    if os.getpid() == pid:  # never the parent's helpers from a forked copy
        for helper in list(helpers):
            _end(helper)


def _exit_reason(helper: subprocess.Popen) -> str:
    code = helper.returncode
    if code is not None and code < 0:
        return f"its process was killed by signal {-code}"
    return f"its process exited with code {code}"


def _receive(fd: int, deadline: Deadline) -> Any:
    """The next message on `fd`, or None if the deadline passes first."""
    head = _read(fd, _LENGTH.size, deadline)
    if head is None:
        return None
    body = _read(fd, _LENGTH.unpack(head)[0], deadline)
    return None if body is None else pickle.loads(body)


def _read(fd: int, n: int, deadline: Deadline) -> bytearray | None:
    """n bytes from the pipe `fd`, or None at the deadline; EOFError if its writer is gone."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    out = bytearray(n)
    view, done = memoryview(out), 0
    while done < n:
        left = deadline.remaining()
        if left <= 0:
            return None
        if not poller.poll(left * 1000):
            continue  # the deadline passed, or moved later meanwhile
        got = os.readv(fd, [view[done:]])
        if not got:
            raise EOFError
        done += got
    return out


def _send(pipe: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_LENGTH.pack(len(body)) + body)
    pipe.flush()


# -- the helper's side ---------------------------------------------------------------------------


def _serve(parent_path: str) -> None:
    """The helper's loop: (regex, max_states) in, ("ok" | "too_many_states" | "refused", value,
    retire) out, until the parent closes the pipe, kills the helper or dies."""
    import resource

    sys.path.extend(p for p in parent_path.split(os.pathsep) if p not in sys.path)
    # The parent ends helpers by closing or killing them; a Ctrl-C meant for it must not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    # Replies go out on the original stdout; anything printed goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    source = sys.stdin.buffer
    while True:
        head = source.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return
        regex, max_states = pickle.loads(source.read(_LENGTH.unpack(head)[0]))
        try:
            reply: tuple[str, Any] = ("ok", tuple(build_dfa(regex, max_states)))
        except TooManyStates as e:
            reply = ("too_many_states", e.n_states)
        except Exception as e:  # outlines-core's refusal, whatever its type
            reply = ("refused", (str(e).splitlines() or [type(e).__name__])[0][:500])
        retire = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > _RETIRE_PEAK_KIB
        _send(out, (*reply, retire))
        if retire:
            return


def _exit_with_parent() -> None:
    """End this process if its parent dies mid-build (a build that is never answered)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


__all__ = [
    "BuildStopped",
    "Deadline",
    "DfaBuilders",
    "DfaRefused",
    "RawDfa",
    "TooManyStates",
    "build_dfa",
]

if __name__ == "__main__":
    _serve(sys.argv[1] if len(sys.argv) > 1 else "")
