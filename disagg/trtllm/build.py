"""Runs the per-role engine builds: incremental, one log per role, stopping at the first failure.

A role is rebuilt only when its fingerprint changes: the exact command lines (so every limit, TP/PP,
dtype and path), the TensorRT-LLM version (engines do not carry across releases), and the HF
checkpoint's `config.json`, safetensors index and each shard's size and mtime. Shards are not hashed:
reading 16 GB of weights on every run would cost minutes for a check that mtime already answers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

from disagg.placement.inventory import GpuInventory, inventory
from disagg.spec import HARDWARE, DeploymentSpec, SpecError
from disagg.trtllm import versions
from disagg.trtllm.commands import Command, checkpoint_dir, convert_script, role_commands, role_spec
from disagg.trtllm.render import check_spec

TAIL_LINES = 20


class BuildError(RuntimeError):
    """A build step failed; the message names the command and ends with its last log lines."""


def dry_run_lines(spec: DeploymentSpec, roles: list[str]) -> list[str]:
    """The exact commands `build_roles` would run (for the targeted release), one shell line each."""
    _check(spec, roles)
    return [cmd.shell() for name in roles for cmd in role_commands(spec, name)]


def pin_release(spec: DeploymentSpec) -> DeploymentSpec:
    """The spec with `trtllm_release` set to the installed TensorRT-LLM's line; an error when the spec
    names another (engines, configs and launch script must all be for the release that runs them)."""
    version = versions.detect_version()
    installed = versions.find(version)
    if spec.trtllm_release is not None and versions.release_of(spec) != installed:
        raise SpecError("trtllm_release", f"{spec.trtllm_release!r}, but the installed TensorRT-LLM is {version} ({installed.image})")
    return dataclasses.replace(spec, trtllm_release=installed.name)


def build_roles(spec: DeploymentSpec, roles: list[str], force: bool) -> list[str]:
    """Builds each role's engine unless it is up to date (or `force`); returns the roles rebuilt.
    `spec` has its release pinned (`pin_release`)."""
    _check(spec, roles)
    inv = inventory()
    if inv is not None:
        _check_architecture(spec, roles, inv)
    version = versions.detect_version()
    _check_tools(spec, version)
    local_gpus = len(inv.gpus) if inv else None
    return [name for name in roles if _build_role(spec, name, version, local_gpus, force)]


def _check_architecture(spec: DeploymentSpec, roles: list[str], inv: GpuInventory) -> None:
    """A TensorRT engine runs only on the GPU architecture it was built on: each role is built on a GPU of
    its pool's hardware class (spec.HARDWARE)."""
    here = {g.compute_capability for g in inv.gpus if g.compute_capability}
    for pool in spec.pools.values():
        wanted = HARDWARE[pool.hardware]
        for name in (r for r in roles if r in pool.roles):
            if here and wanted not in here:
                raise BuildError(
                    f"[{name}] pools.{pool.name} runs on {pool.hardware} ({wanted}), but this machine's GPUs are "
                    f"{', '.join(sorted(here))} ({inv.gpus[0].name}): an engine built here would not run there. "
                    f"Build it on a {pool.hardware}: build-engines --config {spec.source or '<spec>'} --only {name}"
                )


def _check(spec: DeploymentSpec, roles: list[str]) -> None:
    """Every spec error before any work: the roles asked for, and what serving them will need."""
    for name in roles:
        role_spec(spec, name)
    check_spec(spec)


def _check_tools(spec: DeploymentSpec, version: str) -> None:
    release = versions.release_of(spec)
    script = convert_script(release)
    if not script.is_file():
        raise BuildError(
            f"{script} not found: set TRTLLM_EXAMPLES_DIR to the TensorRT-LLM examples dir "
            f"(in the NGC images: {versions.DEFAULT_EXAMPLES_DIR}); TensorRT-LLM {version} keeps the Llama "
            f"converter at <examples>/{release.converter}"
        )
    if shutil.which("trtllm-build") is None:
        raise BuildError("trtllm-build not found on PATH: it is installed with TensorRT-LLM")
    if not (spec.model.path / "config.json").is_file():
        raise SpecError("model.path", f"{spec.model.path} has no config.json: the converter needs a Hugging Face checkpoint")


def _fingerprint(commands: tuple[Command, ...], version: str, model_dir: Path) -> str:
    digest = hashlib.sha256()
    for cmd in commands:
        digest.update(cmd.shell().encode() + b"\n")
    digest.update(f"tensorrt_llm {version}\n".encode())
    for name in ("config.json", "model.safetensors.index.json"):
        path = model_dir / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-") + b"\n")
    for shard in sorted(model_dir.glob("*.safetensors")):
        stat = shard.stat()
        digest.update(f"{shard.name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _engine_complete(engine: Path, world_size: int) -> bool:
    """`Engine.save()` writes `rank{R}.engine` per rank and one `config.json` (from rank 0)."""
    return (engine / "config.json").is_file() and all((engine / f"rank{r}.engine").is_file() for r in range(world_size))


def _recorded_fingerprint(manifest: Path) -> str | None:
    try:
        return json.loads(manifest.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _build_role(spec: DeploymentSpec, name: str, version: str, local_gpus: int | None, force: bool) -> bool:
    role = spec.roles[name]
    commands = role_commands(spec, name, local_gpus=local_gpus)
    work = spec.build_dir / "trtllm" / name
    manifest, log, engine = work / "manifest.json", work / "build.log", spec.engine_dir(name)
    current = _fingerprint(commands, version, spec.model.path)
    if not force and _recorded_fingerprint(manifest) == current and _engine_complete(engine, role.world_size):
        print(f"[{name}] up to date ({engine})", flush=True)
        return False

    # A stale rank file from an earlier TP/PP must not sit next to the new ones.
    for stale in (checkpoint_dir(spec, name), engine):
        shutil.rmtree(stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    manifest.unlink(missing_ok=True)
    log.write_text("")
    ranks = "0" if role.world_size == 1 else f"0-{role.world_size - 1}"
    started = time.monotonic()
    for cmd in commands:
        print(f"[{name}] {cmd.step} rank {ranks} (TP {role.tp} x PP {role.pp}) ... log: {log}", flush=True)
        _run(cmd, log)
    if not _engine_complete(engine, role.world_size):
        raise BuildError(
            f"[{name}] trtllm-build exited 0 but {engine} lacks config.json or rank0..{role.world_size - 1}.engine; see {log}"
        )
    record = {"fingerprint": current, "tensorrt_llm": version, "commands": [c.shell() for c in commands]}
    manifest.write_text(json.dumps(record, indent=2) + "\n")
    print(f"[{name}] built in {time.monotonic() - started:.1f} s: {engine}", flush=True)
    return True


def _run(cmd: Command, log: Path) -> None:
    """Runs one step with stdout and stderr going straight into the role's log as they are written."""
    with log.open("a") as out:
        out.write(f"$ {cmd.shell()}\n")
        out.flush()
        try:
            returncode = subprocess.run(cmd.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        except OSError as exc:
            raise BuildError(f"[{cmd.role}] {cmd.step} could not start ({exc.strerror}): {cmd.shell()}") from exc
    if returncode:
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        raise BuildError(
            f"[{cmd.role}] {cmd.step} failed with exit code {returncode}: {cmd.shell()}\n"
            f"last {len(tail)} lines of {log}:\n" + "\n".join(tail)
        )
