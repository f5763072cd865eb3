"""`build-engines`: validate a deployment spec, build one engine set per role, render the model repository.

    build-engines --config configs/cpu-tiny.yaml            # build what changed, render the repository
    build-engines --config X --only decode --force          # rebuild one role
    build-engines --config X --dry-run                      # print the build commands, run nothing
    build-engines plan --config X                           # GPU placement table and checks
    build-engines manifests --config X [--out DIR]          # Kubernetes manifests only (spec with pools)

The spec is checked against the model's config.json at model.path. Where the checkpoint is not on this machine (a
GPU spec looked at from a laptop), `--model-config FILE` gives that config.json for --dry-run, plan and manifests,
e.g. configs/models/Llama-3.1-8B-Instruct.json; a build reads the checkpoint itself.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disagg.backend import backend_for
from disagg.render import render_repository
from disagg.spec import ROLES, DeploymentSpec, SpecError, load_spec, with_engine_root


def build(spec: DeploymentSpec, only: list[str] | None = None, force: bool = False, render: bool = True, log=print) -> list[str]:
    """Builds the spec's roles (or `only` those) and renders the repository; returns the roles rebuilt."""
    backend = backend_for(spec)
    spec = backend.prepare(spec)
    rebuilt = backend.build_roles(spec, only or list(spec.roles), force, log)
    if render:
        changed = render_repository(spec, spec.model_repository)
        log(f"model repository {spec.model_repository}: " + (f"{len(changed)} files written" if changed else "up to date"))
        if spec.kubernetes is not None:
            _write_manifests(spec, manifests_dir(spec), log)
    if not rebuilt:
        log("nothing to rebuild: every engine is up to date")
    return rebuilt


def manifests_dir(spec: DeploymentSpec) -> Path:
    """Where the Kubernetes manifests go by default: k8s/ beside the model repository."""
    return spec.model_repository.parent / "k8s"


def _write_manifests(spec: DeploymentSpec, out: Path, log) -> None:
    from disagg.k8s.manifests import write_manifests

    changed = write_manifests(spec, out)
    log(f"kubernetes manifests {out}: " + (f"{len(changed)} files written" if changed else "up to date"))


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="deployment spec (YAML)")
    p.add_argument("--model-config", type=Path, help="the model's config.json, where model.path has none on this machine")
    return p


def _plan(argv: list[str]) -> int:
    args = _parser("build-engines plan").parse_args(argv)
    from disagg.placement.inventory import inventory
    from disagg.placement.plan import format_plan, make_plan

    print(format_plan(make_plan(load_spec(args.config, args.model_config), inventory())))
    return 0


def _manifests(argv: list[str]) -> int:
    parser = _parser("build-engines manifests")
    parser.add_argument("--out", type=Path, help="directory to write into (default: k8s/ beside the model repository)")
    args = parser.parse_args(argv)
    spec = load_spec(args.config, args.model_config)
    if spec.kubernetes is None:
        raise SpecError("kubernetes", "required: the spec has no kubernetes section (namespace, image, claims)")
    _write_manifests(spec, args.out or manifests_dir(spec), print)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["plan"]:
            return _plan(argv[1:])
        if argv[:1] == ["manifests"]:
            return _manifests(argv[1:])
        parser = _parser("build-engines")
        parser.add_argument("--only", action="append", choices=ROLES, help="build only this role (repeatable)")
        parser.add_argument("--force", action="store_true", help="rebuild even when the manifest says up to date")
        parser.add_argument("--dry-run", action="store_true", help="print the build commands and exit")
        parser.add_argument("--no-render", action="store_true", help="skip rendering the model repository")
        parser.add_argument("--engine-root", help="absolute path under which the serving host sees the engines "
                            "(e.g. a container mount); overrides output.engine_root")
        args = parser.parse_args(argv)
        if args.model_config is not None and not args.dry_run:
            raise SpecError("--model-config", "for --dry-run, plan and manifests only: a build reads the checkpoint at model.path")
        spec = load_spec(args.config, args.model_config)
        if args.engine_root is not None:
            spec = with_engine_root(spec, args.engine_root)
        missing = [r for r in args.only or [] if r not in spec.roles]
        if missing:
            raise SpecError(f"roles.{missing[0]}", f"--only {missing[0]}: the spec has no such role")
        if args.dry_run:
            print("\n".join(backend_for(spec).dry_run_lines(spec, args.only or list(spec.roles))))
            return 0
        build(spec, args.only, args.force, render=not args.no_render)
        return 0
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:  # a build that failed; manifests that fail the lint
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
