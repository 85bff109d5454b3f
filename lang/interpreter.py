"""The interpreter: a program state executes its expressions in a worker thread of its own.

`s += gen(...)` queues the expression and returns at once; reading a variable (`s["x"]`) waits for
it, `s.text()` waits for everything queued. So forks run side by side and their generations are
batched by the engine, and a streamed run shows text as it is generated.

A failure inside an expression (a bad regex, a server error) is kept on the state
(`state.error()`); the expressions queued after it are skipped, and reading a variable that was
never set raises `ProgramError` naming the cause.

This module knows states, not programs: running a `@function` (`run`, `run_batch`) is
`lang/program.py`'s. A backend call is given a `PromptContext`, not the executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import random
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixlm.lang.backend import Backend, PromptContext
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import (
    CommitLazy,
    ConcatenateAndAppend,
    ConstantText,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)

logger = logging.getLogger(__name__)

_END = object()  # the worker's stop sentinel


class ProgramError(RuntimeError):
    """A program's variable was never set because an earlier step failed."""


class StreamExecutor:
    """Executes one state's expressions in order, in its own thread."""

    def __init__(
        self,
        backend: Backend,
        arguments: dict[str, Any],
        default_params: GenParams,
        chat_template: ChatTemplate | None,
        stream: bool,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_params = default_params
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()

        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.error_: BaseException | None = None
        self.is_finished = False
        self.rng = random.Random()

        self._scopes: dict[str, int] = {}
        self._changed = threading.Condition()
        self._writers: dict[str, int] = {}  # queued steps that will set each variable
        self._ended = False
        self._children: list[StreamExecutor] = []  # its forks, ended with it
        self._queue: queue.Queue[Any] = queue.Queue()
        # a streamed run's program body, still submitting steps in its own thread
        self._body: threading.Thread | None = None
        self._worker = threading.Thread(
            target=self._work, name=f"radixlm-program-{self.sid[:8]}", daemon=True
        )
        self._worker.start()

    # ---- the caller's side ----------------------------------------------------------------

    def submit(self, expr: Any) -> None:
        expr = as_expr(expr)
        if self._ended:
            raise RuntimeError("this program state has ended (its fork was joined)")
        self._init_var_events(expr)
        self._queue.put(expr)

    def sync(self) -> None:
        """Wait for every step of the program: in a streamed run, for its body to have
        submitted them all too (unless asked from the body itself)."""
        body = self._body
        if body is not None and body is not threading.current_thread():
            body.join()
        self._queue.join()

    def end(self) -> None:
        """No more work after what is queued: its worker thread then exits. Its forks end with
        it (a fork never joined kept its thread for as long as anything held the state, e.g.
        through a failed program's exception)."""
        if not self._ended:
            self._ended = True
            self._queue.put(_END)
            for child in self._children:
                child.end()

    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(
                f"variable {name!r} was not set: the program failed: {self.error_!r}"
            ) from self.error_
        raise KeyError(f"no variable {name!r}; the state has {sorted(self.variables)}")

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value
        self._notify()

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        event = self.variable_event.get(name)
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"timed out waiting for {name!r}")
        return self.meta_info.get(name)

    def fork(self, size: int) -> list[StreamExecutor]:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork(size={size!r}): size must be a positive integer")
        self.sync()
        if size > 1 and self.text_ and self.error_ is None:
            # the shared prefix is computed once, before the forks ask for it together
            self.submit(CommitLazy())
            self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend, self.arguments, self.default_params, self.chat_template, self.stream
            )
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            child.error_ = self.error_
            children.append(child)
        # forks already ended (joined) are let go: a program forking in a loop held every one
        self._children = [c for c in self._children if not c._ended] + children
        return children

    def wait_chunk(self, var_name: str | None, pos: int) -> tuple[str, bool]:
        """Block until the text (or variable) grows past `pos` or is final: (new text, final)."""
        with self._changed:
            while True:
                if var_name is None:
                    current, done = self.text_, self.is_finished
                else:
                    value = self.variables.get(var_name)
                    current = value if isinstance(value, str) else ""
                    event = self.variable_event.get(var_name)
                    done = self.is_finished or (event is not None and event.is_set())
                    # shorter than what was read: a later gen of the name began anew (the
                    # stream of the first one is over)
                    done = done or len(current) < pos
                if len(current) > pos or done:
                    return current[pos:], done
                self._changed.wait()

    # ---- the worker's side ----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                self._finish()
                self._queue.task_done()
                return
            try:
                if self.error_ is None:
                    self._execute(expr)
            except Exception as e:
                logger.warning("program step %r failed: %s", expr, e)
                logger.debug("program step failure", exc_info=True)
                self.error_ = e
            finally:
                if self.error_ is not None:
                    self._release_events()  # waiters on skipped variables must not hang
                self._notify()
                self._queue.task_done()

    def _finish(self) -> None:
        self._release_events()
        self.is_finished = True
        self._notify()

    def _release_events(self) -> None:
        for event in list(self.variable_event.values()):
            event.set()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _init_var_events(self, expr: Expr) -> None:
        """Count the queued writers of each variable: reading one waits for the last of them
        (a name generated twice in a row was read as its first value)."""
        if isinstance(expr, (Gen, Select, VarScopeBegin)) and expr.name is not None:
            self._count_writer(expr.name)
        elif isinstance(expr, SeparateReasoning):  # (it writes each name again)
            for name in expr.names:
                self._count_writer(name)
                self._count_writer(expr.reasoning_name(name))
        elif isinstance(expr, ExprList):
            for e in expr.exprs:
                self._init_var_events(e)

    def _count_writer(self, name: str) -> None:
        with self._changed:
            self._writers[name] = self._writers.get(name, 0) + 1
            event = self.variable_event.get(name)
            if event is None or event.is_set():
                self.variable_event[name] = threading.Event()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ConstantText):
            self._fill(expr.value)
        elif isinstance(expr, ExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self._set(expr.name, self.text_[self._scopes.pop(expr.name, len(self.text_)) :])
        elif isinstance(expr, CommitLazy):
            self.backend.commit_lazy_operations(self._prompt())
        elif isinstance(expr, ConcatenateAndAppend):
            self._concatenate_and_append(expr.states)
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        from radixlm.protocol.reasoning import reasoning_parser

        parser = reasoning_parser(expr.model_type)
        for name in expr.names:
            output = self.variables.get(name)
            outputs = output if isinstance(output, list) else [output]
            splits = [parser.split(o) if isinstance(o, str) else (None, o) for o in outputs]
            answers = [answer for _, answer in splits]
            thinking = [reasoning or "" for reasoning, _ in splits]
            if isinstance(output, str) and self.text_.endswith(output):
                self.text_ = self.text_[: len(self.text_) - len(output)] + answers[0]
            many = isinstance(output, list)
            self._set(name, answers if many else answers[0], self.meta_info.get(name))
            self._set(expr.reasoning_name(name), thinking if many else thinking[0])

    def _concatenate_and_append(self, states: list[ProgramState]) -> None:
        children = [state.stream_executor for state in states]
        for child in children:
            child.sync()
        for child in children:
            if child.error_ is not None:  # its text stops where it failed: nothing is appended
                raise child.error_
        self._fill("".join(child.text_[child.fork_start_text_pos or 0 :] for child in children))

    def _fill(self, value: str) -> None:
        self.text_ += str(value)
        self._notify()

    def _set(self, name: str | None, value: Any, meta: Any = None) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        with self._changed:
            left = self._writers[name] = max(0, self._writers.get(name, 0) - 1)
            event = self.variable_event.setdefault(name, threading.Event())
        if not left:  # (a later queued gen of the same name will write it again)
            event.set()
        self._notify()

    def _prompt(self) -> PromptContext:
        """What the backend reads of this state for its next call."""
        return PromptContext(
            self.text_, tuple(self.messages_), self.cur_role, self.cur_role_begin_pos
        )

    def _params(self, gen: Gen) -> GenParams:
        return self.default_params.merged(gen.params).resolved(self.chat_template.stop_str)

    def _gen(self, gen: Gen) -> None:
        params = self._params(gen)
        if self.stream and (params.n or 1) == 1:
            self._gen_stream(gen.name, params)
            return
        comp, meta = self.backend.generate(self._prompt(), params)
        self._fill(comp[0] if isinstance(comp, list) else comp)
        self._set(gen.name, comp, meta)

    def _gen_stream(self, name: str | None, params: GenParams) -> None:
        key = name if name is not None else f"__gen_{uuid.uuid4().hex}"
        self.variables[key] = ""
        meta: dict[str, Any] | None = None
        try:
            for chunk, meta in self.backend.generate_stream(self._prompt(), params):
                self.variables[key] += chunk
                self.meta_info[key] = meta
                self._fill(chunk)
        except BaseException:
            # the text so far is not the variable's value: reading it raises ProgramError
            self.variables.pop(key, None)
            self.meta_info.pop(key, None)
            raise
        if name is None:
            self.variables.pop(key, None)
            self.meta_info.pop(key, None)
        else:
            self._set(name, self.variables[name], meta)

    def _select(self, select: Select) -> None:
        decision = self.backend.select(
            self._prompt(), select.choices, select.temperature, select.choices_method, self.rng
        )
        self._fill(decision.decision)
        self._set(select.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(
                f"cannot begin a {role} message inside the {self.cur_role} message: "
                "roles do not nest; end the current one first"
            )
        if not self.messages_ and role != "system":
            default = self.chat_template.default_system_prompt
            if default:
                self._role_begin("system")
                self._fill(default)
                self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self._fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(
                f"{role}_end() without a matching {role}_begin() (the open role is "
                f"{self.cur_role!r})"
            )
        content = self.text_[self.cur_role_begin_pos or 0 :].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = None
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})


class ProgramState:
    """What a program's `s` is, and what `run` returns: its text, variables and messages."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---- building ---------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self.stream_executor.submit(ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return None

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes the variable `name`."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` copies of this state that continue independently (and in parallel); the
        prefix they share is computed once and reused from the prefix cache."""
        children = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    @contextlib.contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading ----------------------------------------------------------------------------

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        self.stream_executor.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable) piece by piece as it is generated, with `stream=True`;
        without streaming, the whole of it once it is there."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        pos = 0
        while True:
            chunk, done = ex.wait_chunk(var_name, pos)
            pos += len(chunk)
            if chunk:
                yield chunk
            if done:
                return

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for coroutines (waits off the event loop); with `return_meta_data` it
        yields (text, meta_info) pairs."""
        ex = self.stream_executor
        if not ex.stream:
            if var_name is None:
                value = await asyncio.to_thread(self.text)
            else:
                value = await asyncio.to_thread(self.get_var, var_name)
            meta = self.get_meta_info(var_name) if var_name is not None else None
            yield (value, meta) if return_meta_data else value
            return
        pos = 0
        while True:
            chunk, done = await asyncio.to_thread(ex.wait_chunk, var_name, pos)
            pos += len(chunk)
            if chunk:
                if return_meta_data:
                    yield chunk, ex.meta_info.get(var_name) if var_name else None
                else:
                    yield chunk
            if done:
                return

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stream_executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states `fork` makes. `join()` ends them and gathers their new variables as lists on
    the parent (`s["idea"] == [idea of fork 0, idea of fork 1, ...]`)."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        if mode == "gather_variable":
            self._gather_variables()
        elif mode == "concate_and_append":
            self.src_state += ConcatenateAndAppend(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"join(mode={mode!r}): use 'gather_variable' or 'concate_and_append'")
        for state in self.states:
            state.stream_executor.end()

    def _gather_variables(self) -> None:
        """The forks' new variables as lists on the parent, item i from fork i. If a fork
        failed, none is gathered (its items would be missing, the lists shifted): the parent
        takes its error, and reading a gathered variable raises ProgramError naming it."""
        parent = self.src_state.stream_executor
        children = [state.stream_executor for state in self.states]
        for child in children:
            child.sync()
        failed = next((c.error_ for c in children if c.error_ is not None), None)
        if failed is not None:
            if parent.error_ is None:
                parent.error_ = failed
            return
        known = set(parent.variables)
        for child in children:
            for name in child.variables.keys() - known:
                parent.variables.setdefault(name, []).append(child.variables[name])
                parent.meta_info.setdefault(name, []).append(child.meta_info.get(name))

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: Any) -> None:
        # `forks[i] += expr` adds in place, then stores the same state back at i
        if state is not self.states[i]:
            raise TypeError(
                f"forks[{i}] can only be assigned its own state back, as `forks[{i}] += expr` "
                f"does (got a {type(state).__name__}); a fork cannot be replaced"
            )

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self
