"""DeepSpeed's JIT-built C++ ops: the cache folder of this environment, whether loading will compile, and loading
that says so and never hangs behind a dead process's lock.

Where. DeepSpeed JIT-builds its ops with torch's extension loader into TORCH_EXTENSIONS_DIR/<op>/, by default one
folder per Python version shared by every environment on the machine. A folder holds one build: its `build.ninja`
names the absolute paths of the sources and headers of the environment that built it (.../site-packages/deepspeed/
ops/csrc/..., .../torch/include, Python's include folder), and ninja rebuilds when they change. So two environments
sharing a folder rebuild it in turn, even with the same versions (two clones' virtualenvs, a worktree's, a
benchmark's): 27 full rebuilds in an hour, 0.5-4.6 min each, before this key (issue 32). Unless the user sets
TORCH_EXTENSIONS_DIR, memlm keys the folder by everything a build reads: Python, torch and DeepSpeed versions, the
CPU model (builds may use -march=native), and the folders the sources and headers come from, as imported (not
resolved: the loader writes them as they are). Each environment builds once and keeps its build.

Which ninja. torch runs whichever `ninja` the PATH finds first, and ninja versions disagree about a build: this
machine has the environment's own (pip's ninja 1.13, a DeepSpeed dependency, in .venv/bin) and the system's 1.11,
and what one built the other found "command line changed" and rebuilt. So a shell with the environment activated
(.venv/bin first on the PATH) and one without it (the test suite, `.venv/bin/memlm`) rebuilt the op in turn. memlm
loads the op with the environment's own ninja first on the PATH when it has one (the ninja beside the
interpreter), and keys the folder by the ninja it uses.

Whether a load compiles. A load compiles when the folder holds no library, or its build.ninja names other sources
or headers than this environment's (a TORCH_EXTENSIONS_DIR the user shares), or a source is newer than the library:
`build_due` says which, so the notice is printed whenever a build is coming rather than only when no library exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from . import heartbeat
from .quiet import into_library_log

STALE_LOCK_SECONDS = 300  # an op build takes 0.5-5 min; a lock this old was left by a process killed mid-build
LOAD_GUARD = ".memlm-op-load.lock"  # memlm's own flock in the cache folder (load_cpu_op)


def environment_versions() -> dict[str, str]:
    """The versions a JIT-built op depends on, read without importing the packages."""
    from importlib import metadata

    versions = {"py": platform.python_version()}
    for name in ("torch", "deepspeed"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "none"
    return versions


def build_ninja() -> str | None:
    """The ninja that builds this environment's ops: its own (beside the interpreter), else the PATH's."""
    own = Path(sys.executable).parent / "ninja"
    if own.is_file() and os.access(own, os.X_OK):
        return str(own)
    return shutil.which("ninja")


def build_roots() -> dict[str, str]:
    """What a build reads from this environment, found without importing anything: the DeepSpeed package (its
    csrc/), the torch package (its include/), Python's include folder, and the ninja that builds."""
    roots = {"python_include": sysconfig.get_paths().get("include", ""), "ninja": build_ninja() or "none"}
    for name in ("torch", "deepspeed"):
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        roots[name] = os.path.abspath(locations[0]) if locations else "none"
    return roots


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def extension_cache_dir(versions: dict[str, str] | None = None, roots: dict[str, str] | None = None) -> Path:
    """The op cache of this environment: ~/.cache/memlm/torch_extensions/<machine>-<key of versions, CPU, roots>."""
    versions = versions or environment_versions()
    roots = roots or build_roots()
    key = "-".join(f"{name}{versions[name]}" for name in sorted(versions))
    where = "|".join(f"{name}={roots[name]}" for name in sorted(roots))
    digest = hashlib.sha256(f"{key}|{cpu_model()}|{where}".encode()).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "memlm" / "torch_extensions" / f"{platform.machine()}-{digest}"


def use_own_extension_cache() -> str:
    """Point TORCH_EXTENSIONS_DIR at this environment's cache unless the user chose one; returns the folder.
    Also exported to child processes (DeepSpeed's launcher ranks, Ray workers through ray_runtime.worker_env).
    Must run before deepspeed builds or loads an op."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extension_cache_dir())
    own_ninja_first_on_path()
    return os.environ["TORCH_EXTENSIONS_DIR"]


def own_ninja_first_on_path() -> None:
    """The environment's own ninja first on this process's PATH, which its children inherit.

    load_cpu_op builds with it, but DeepSpeed loads the op by itself wherever memlm's loader did not run first (a
    process that calls deepspeed.initialize directly, a helper of the test suite): torch's loader then ran the
    PATH's ninja, the system's 1.11 where the environment was not activated, which rebuilt the folder's build of
    1.13 ("command line changed": the two hash their logs differently) and made the next memlm start rebuild it
    back and print the build notice (issue 32, seen in CI). A no-op without an own ninja, or when it is first."""
    own = Path(sys.executable).parent / "ninja"
    if not (own.is_file() and os.access(own, os.X_OK)):
        return
    folders = os.environ.get("PATH", "").split(os.pathsep)
    if folders and folders[0] == str(own.parent):
        return
    os.environ["PATH"] = os.pathsep.join([str(own.parent), *[f for f in folders if f]])


def warn_stale_build_locks(folder: str | os.PathLike, now: float | None = None) -> list[Path]:
    """Op build locks in FOLDER older than STALE_LOCK_SECONDS, each named in one warning line.

    torch's extension builder holds a plain `lock` file while it compiles and every other process waits, forever,
    for it to disappear; a builder killed mid-build (Ctrl-C, SIGKILL, a preempted node) leaves it behind, and every
    later run then hangs silently right after its thread line. Deleting it is safe once no build is running, which
    only the user can know, so this says what to delete instead of deleting it."""
    now = time.time() if now is None else now
    stale = []
    for lock in sorted(Path(folder).glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # removed by its builder meanwhile
            continue
        if age > STALE_LOCK_SECONDS:
            stale.append(lock)
            print(f"memlm: warning: {lock} is {age / 60:.0f} min old: DeepSpeed will wait for it forever; if no other "
                  "process is building that op, delete it", file=sys.stderr, flush=True)
    return stale


# ---------------------------------------------------------------------------------------------------------------
# Loading DeepSpeed's CPU communication op


def build_due(op_dir: Path, sources: list[str], includes: list[str], ninja: str | None = None) -> str | None:
    """Why loading the op kept in OP_DIR will compile it (None: it loads the library as it is).

    sources and includes: the absolute paths this environment's loader passes (they land in build.ninja as they are).
    ninja: the ninja that will build, asked last (a dry run: it writes nothing) whether it finds work to do."""
    name = op_dir.name
    library = op_dir / f"{name}.so"
    if not library.is_file():
        return f"no build in {op_dir} yet"
    try:
        rules = (op_dir / "build.ninja").read_text()
    except OSError:
        return f"{op_dir} holds no build.ninja"
    missing = [path for path in [*sources, *includes] if path not in rules]
    if missing:
        return (f"{op_dir} holds a build from another environment ({_built_from(rules) or 'other paths'}), "
                f"not of {missing[0]}")
    built = library.stat().st_mtime
    newer = [path for path in sources if os.path.exists(path) and os.stat(path).st_mtime > built]
    if newer:
        return f"{newer[0]} is newer than the build in {op_dir}"
    if ninja:
        try:
            dry = subprocess.run([ninja, "-C", str(op_dir), "-n", "-d", "explain"], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if dry.returncode == 0 and "no work to do" not in dry.stdout:
            why = next((line.removeprefix("ninja explain: ") for line in dry.stderr.splitlines()
                        if line.startswith("ninja explain:")), "it finds work to do")
            return f"ninja ({ninja}) rebuilds the build in {op_dir}: {why} (built by another ninja?)"
    return None


def _built_from(rules: str) -> str:
    """The DeepSpeed folder a build.ninja's sources come from (what a person recognises), else ''."""
    for line in rules.splitlines():
        if line.startswith("build ") and "/deepspeed/ops/csrc/" in line:
            return line.rsplit(" ", 1)[-1].split("/deepspeed/ops/csrc/")[0] + "/deepspeed"
    return ""


def load_cpu_op(log_dir: str | os.PathLike, speak: bool) -> None:
    """Load (building it if due) DeepSpeed's CPU communication op, as deepspeed.init_distributed would, with its
    output in LOG_DIR/library.log; `speak` (rank 0): say on the console when a build is coming, and while it runs.

    Never behind a dead process's lock: torch's extension loader holds a plain `lock` file in the op's folder while
    it builds or loads, and every other process waits for that file to go, forever; a process killed in that moment
    (Ctrl-C during a sweep's trial start) hung every later run on the machine. So the load runs under an flock of
    memlm's own, which the kernel releases when its holder dies: whoever holds it knows that a `lock` left in memlm's
    own op cache belongs to a dead process and removes it. DeepSpeed keeps the loaded op, so init_distributed does
    not load it again. In a TORCH_EXTENSIONS_DIR the user chose, other programs may be building: there the lock is
    only named in a warning (warn_stale_build_locks)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # DeepSpeed will not use it either
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    ninja = build_ninja()
    reason = build_due(cache / builder.name, *_build_inputs(builder), ninja=ninja)
    if reason is not None:
        if speak:
            print(f"memlm: building DeepSpeed's CPU communication op for this environment (0.5-5 min; once per "
                  f"environment): {reason}", file=sys.stderr, flush=True)
            heartbeat.said()
        heartbeat.phase("building DeepSpeed's CPU communication op")
    else:
        heartbeat.phase("loading DeepSpeed's CPU communication op")
    cache.mkdir(parents=True, exist_ok=True)
    with into_library_log(log_dir), open(cache / LOAD_GUARD, "a") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process of this environment is loading or building it: wait for that one
            heartbeat.phase(f"waiting for another process that loads or builds DeepSpeed's CPU op in {cache}")
            fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            stale = cache / builder.name / "lock"
            if stale.exists() and cache == extension_cache_dir():
                stale.unlink(missing_ok=True)
            with _first_on_path(Path(ninja).parent if ninja else None):
                builder.load()
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


@contextlib.contextmanager
def _first_on_path(folder: Path | None):
    """FOLDER first on the PATH for the block (torch runs `ninja` from the PATH): the build's ninja, every time."""
    if folder is None:
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(folder), saved]) if saved else str(folder)
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _build_inputs(builder) -> tuple[list[str], list[str]]:
    """The sources and include folders this environment's loader passes for `builder` (DeepSpeed's jit_load)."""
    from torch.utils.cpp_extension import include_paths

    sources = [os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.strip_empty_entries(builder.sources())]
    includes = [os.path.abspath(builder.deepspeed_src_path(p))
                for p in builder.strip_empty_entries(builder.include_paths())]
    return sources, [*includes, *include_paths(), sysconfig.get_paths()["include"]]
