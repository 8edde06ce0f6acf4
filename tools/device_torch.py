"""Another torch on the GPU machine: pack its wheels here, carry them in pieces, install them there.

The device tool carries at most 64 MiB a call (the working tree included) and keeps nothing of
the repository between calls, but files copied outside the repository on a warm machine stay
until it is given back. So a torch release travels as pieces of one compressed archive (torch and
triton unpacked, then xz: about a quarter smaller than the wheels), one piece a call, each call
copying its piece into a stash outside the repository; the last one installs:

    python tools/device_torch.py pack --torch 2.14.1 --triton 3.8.0        # here: .device-torch/
    # then one device call per piece, back to back (the machine goes back after ~30 s idle):
    #   carry [".device-torch/torch2.14.1.json", ".device-torch/torch2.14.1.part00"]
    #   command: python tools/device_torch.py receive .device-torch/torch2.14.1.part00
    # and, in the call after the last piece:
    #   command: eval "$(python tools/device_torch.py install --torch 2.14.1)"; python -c 'import torch; ...'

``install`` unpacks into ``<stash>/torch<version>/site`` and prints the ``export PYTHONPATH=...``
line that puts it first. Torch finds its CUDA libraries (the ``nvidia`` package) relative to its
own folder, so ``site/nvidia`` holds those that travelled and links to the machine's own for the
rest. Where a machine's library is older than the release needs (a missing symbol stops
``import torch``), pack that library's wheel as a bundle of its own and name it at install:

    python tools/device_torch.py pack --name nccl2.30.7 --wheels DIR_WITH_THE_NCCL_WHEEL
    #   ... receive its pieces as above, then:
    #   command: eval "$(python tools/device_torch.py install --torch 2.14.1 --with nccl2.30.7)"

Exit 2 with one line for a missing, corrupt or foreign piece.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DEFAULT_OUT = Path(".device-torch")
DEFAULT_STASH = Path("/root/device-torch")
PIECE_MIB = 58  # 64 MiB a call, less the working tree (about 3 MiB) and the manifest


class Refused(Exception):
    """A bad input, said in one line (exit 2)."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_path(folder: Path, bundle: str) -> Path:
    """A bundle is one packed archive: ``torch<version>`` or another name given at pack."""
    return folder / f"{bundle}.json"


def bundle_of(piece: Path) -> str:
    return piece.name.split(".part")[0]


def read_manifest(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise Refused(f"no manifest {path}; carry it with the piece (python tools/device_torch.py pack writes it)")
    except json.JSONDecodeError as exc:
        raise Refused(f"manifest {path} is not JSON ({exc}); pack again")


def download(torch_version: str, triton_version: str, into: Path) -> list[Path]:
    """The cp312 manylinux wheels the GPU machine's Python takes (pip's cache of this machine)."""
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(into),
                    f"torch=={torch_version}", f"triton=={triton_version}"], check=True)
    return sorted(into.glob("*.whl"))


def extract_wheel(wheel: Path, into: Path) -> None:
    """Unpack a wheel keeping each file's mode: zipfile drops it, and triton's ``ptxas`` must stay
    executable (Inductor runs it)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = Path(archive.extract(info, into))
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                path.chmod(mode)


def pack(wheels: list[Path], bundle: str, out: Path, piece_bytes: int) -> dict:
    """Unpack the wheels, compress them into one archive, split it; write and return the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{bundle}.part*"):
        old.unlink()
    with tempfile.TemporaryDirectory(dir=out) as work:
        site = Path(work) / "site"
        for wheel in wheels:
            print(f"unpacking {wheel.name}", flush=True)
            extract_wheel(wheel, site)
        archive_path = Path(work) / "site.tar.xz"
        print(f"compressing {sum(f.stat().st_size for f in site.rglob('*') if f.is_file()) >> 20} MiB "
              f"(xz, minutes)", flush=True)
        with tarfile.open(archive_path, "w:xz", preset=6) as tar:
            tar.add(site, arcname="site")
        pieces = []
        with open(archive_path, "rb") as f:
            for index, block in enumerate(iter(lambda: f.read(piece_bytes), b"")):
                piece = out / f"{bundle}.part{index:02d}"
                piece.write_bytes(block)
                pieces.append({"name": piece.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
        manifest = {"bundle": bundle, "wheels": [w.name for w in wheels], "archive_sha256": sha256(archive_path),
                    "archive_bytes": archive_path.stat().st_size, "pieces": pieces}
    manifest_path(out, bundle).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def receive(piece: Path, stash: Path) -> list[str]:
    """Copy one carried piece into the stash after checking it; return the pieces still missing."""
    bundle = bundle_of(piece)
    manifest = read_manifest(manifest_path(piece.parent, bundle))
    expected = {p["name"]: p for p in manifest["pieces"]}
    if piece.name not in expected:
        raise Refused(f"{piece.name} is not a piece of {bundle_name(manifest)}'s manifest; pack again")
    if not piece.is_file():
        raise Refused(f"{piece} was not carried; name it in the call's carry")
    if sha256(piece) != expected[piece.name]["sha256"]:
        raise Refused(f"{piece} differs from the manifest's SHA-256; carry it again")
    folder = stash / bundle
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(manifest_path(piece.parent, bundle), folder / "manifest.json")
    shutil.copyfile(piece, folder / piece.name)
    return missing(folder, manifest)


def bundle_name(manifest: dict) -> str:
    # manifests packed before bundles had names carry only the torch release
    return manifest.get("bundle") or f"torch{manifest['torch']}"


def missing(folder: Path, manifest: dict) -> list[str]:
    return [p["name"] for p in manifest["pieces"]
            if not (folder / p["name"]).is_file() or (folder / p["name"]).stat().st_size != p["bytes"]]


def system_nvidia() -> Path | None:
    """The machine's own CUDA libraries (the ``nvidia`` package beside its torch), if any."""
    for entry in sys.path:
        candidate = Path(entry) / "nvidia"
        if entry and candidate.is_dir():
            return candidate
    return None


def unpack_bundle(folder: Path, into: Path) -> None:
    """Join one bundle's stashed pieces, check the archive and unpack its ``site`` into ``into``."""
    manifest = read_manifest(folder / "manifest.json")
    name = bundle_name(manifest)
    lacking = missing(folder, manifest)
    if lacking:
        raise Refused(f"{pretty(name)}: {len(lacking)} of {len(manifest['pieces'])} pieces not received "
                      f"({', '.join(lacking)}); carry each with python tools/device_torch.py receive PIECE")
    done = into / "site" / f".unpacked-{name}"
    if done.exists():
        return
    joined = folder / "site.tar.xz"
    with open(joined, "wb") as out:
        for piece in manifest["pieces"]:
            with open(folder / piece["name"], "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(joined) != manifest["archive_sha256"]:
        joined.unlink()
        raise Refused(f"{pretty(name)}: the joined pieces differ from the packed archive; receive them again")
    with tarfile.open(joined) as tar:
        tar.extractall(into, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(into)
    joined.unlink()
    done.touch()


def pretty(bundle: str) -> str:
    return f"torch {bundle.removeprefix('torch')}" if bundle.startswith("torch") else bundle


def link_machine_libraries(site: Path, nvidia: Path | None) -> None:
    """``site/nvidia``: the libraries that travelled, and links to the machine's own for the rest."""
    if nvidia is None:
        return
    ours = site / "nvidia"
    if ours.is_symlink():  # an install before any library travelled linked the whole folder
        ours.unlink()
    ours.mkdir(exist_ok=True)
    for entry in nvidia.iterdir():
        if not (ours / entry.name).exists() and not (ours / entry.name).is_symlink():
            (ours / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def install(torch_version: str, stash: Path, extras: tuple[str, ...] = ()) -> Path:
    """Join, check and unpack the torch bundle and each extra bundle into one folder; return the
    folder to put first on PYTHONPATH."""
    folder = stash / f"torch{torch_version}"
    for bundle in (f"torch{torch_version}", *extras):
        if not (stash / bundle / "manifest.json").is_file() and bundle in extras:
            raise Refused(f"{bundle}: no piece received; carry each with python tools/device_torch.py receive PIECE")
        unpack_bundle(stash / bundle, folder)
    site = folder / "site"
    link_machine_libraries(site, system_nvidia())
    return site


def mismatched_companions(torch_version: str, packages: tuple[str, ...] = ("torchaudio", "torchvision")) -> list[str]:
    """This machine's packages built for another torch (their wheels pin ``torch==X``), as warnings:
    beside the installed release they may refuse to load (torchaudio refuses a torch built for another
    CUDA), and transformers imports them when they are there."""
    warnings = []
    for package in packages:
        try:
            requires = importlib.metadata.requires(package) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        pinned = [r.split("==", 1)[1].split(";")[0].strip() for r in requires if re.match(r"^torch\s*==", r)]
        if pinned and pinned[0].split("+")[0] != torch_version:
            warnings.append(f"this machine's {package} {importlib.metadata.version(package)} is built for torch "
                            f"{pinned[0]}, not {torch_version}: if importing it fails (transformers does), "
                            f"python3 -m pip uninstall -y {package}, or carry the {package} of torch {torch_version}")
    return warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: wheels -> one xz archive -> pieces and a manifest")
    name = p.add_mutually_exclusive_group(required=True)
    name.add_argument("--torch", help="torch release, e.g. 2.14.1 (the bundle torch<release>)")
    name.add_argument("--name", help="another bundle, e.g. nccl2.30.7, of the wheels in --wheels")
    p.add_argument("--triton", help="the triton release that torch requires (with --download)")
    p.add_argument("--wheels", type=Path, help="a folder holding the wheels already (else they are downloaded)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the pieces go (git-ignored)")
    p.add_argument("--piece-bytes", type=int, default=PIECE_MIB << 20, help="size of a piece")
    r = sub.add_parser("receive", help="there: stash one carried piece outside the repository")
    r.add_argument("piece", type=Path)
    r.add_argument("--stash", type=Path, default=DEFAULT_STASH)
    i = sub.add_parser("install", help="there: join, check and unpack the stashed pieces; prints export PYTHONPATH=...")
    i.add_argument("--torch", required=True)
    i.add_argument("--with", dest="extras", action="append", default=[], metavar="BUNDLE",
                   help="a bundle received beside torch (e.g. nccl2.30.7), unpacked into the same folder")
    i.add_argument("--stash", type=Path, default=DEFAULT_STASH)
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            if args.wheels is not None:
                wheels = sorted(args.wheels.glob("*.whl"))
                if not wheels:
                    raise Refused(f"--wheels {args.wheels} holds no .whl file")
            elif args.torch is None:
                raise Refused("--name takes its wheels from --wheels DIR")
            elif args.triton is None:
                raise Refused("pass --triton (the release torch requires) to download, or --wheels DIR")
            else:
                wheels = download(args.torch, args.triton, args.out / "wheels")
            bundle = args.name or f"torch{args.torch}"
            manifest = pack(wheels, bundle, args.out, args.piece_bytes)
            print(f"{len(manifest['pieces'])} pieces, {manifest['archive_bytes'] >> 20} MiB in all, in {args.out}/; "
                  f"carry each with {manifest_path(args.out, bundle)}")
        elif args.command == "receive":
            left = receive(args.piece, args.stash)
            print(f"stashed {args.piece.name}; " + (f"{len(left)} to come" if left else "all pieces here: install"))
        else:
            site = install(args.torch, args.stash, tuple(args.extras))
            for warning in mismatched_companions(args.torch):
                print(f"warning: {warning}", file=sys.stderr)
            print(f"export PYTHONPATH={site}{os.pathsep}${{PYTHONPATH:-}}")
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
