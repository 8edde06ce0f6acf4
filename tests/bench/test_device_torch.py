"""tools/device_torch.py: a torch release packed into pieces here, received piece by piece and
installed there; a missing, corrupt or foreign piece is one line with exit 2."""

import importlib.util
import random
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("device_torch", ROOT / "tools" / "device_torch.py")
device_torch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_torch)


BLOB = random.Random(0).randbytes(20000)  # incompressible: xz leaves several pieces


def wheel(folder: Path, name: str, files: dict, executable: tuple = ()) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            info = zipfile.ZipInfo(member)
            info.external_attr = (0o755 if member in executable else 0o644) << 16
            archive.writestr(info, text)
    return path


@pytest.fixture
def packed(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "torch-9.9.9-cp312-cp312-linux.whl", {"torch/__init__.py": "__version__ = '9.9.9'\n" + "#" * 5000,
                                                       "torch/lib/blob.bin": BLOB})
    wheel(wheels, "triton-9.0-cp312-cp312-linux.whl", {"triton/__init__.py": "ok = True\n",
                                                      "triton/backends/nvidia/bin/ptxas": "#!/bin/sh\n"},
          executable=("triton/backends/nvidia/bin/ptxas",))
    out = tmp_path / "out"
    assert device_torch.main(["pack", "--torch", "9.9.9", "--wheels", str(wheels), "--out", str(out),
                              "--piece-bytes", "1000"]) == 0
    return out, device_torch.read_manifest(out / "torch9.9.9.json")


def test_pieces_received_in_any_order_install_the_wheels_contents(packed, tmp_path, capsys):
    out, manifest = packed
    names = [p["name"] for p in manifest["pieces"]]
    assert len(names) > 1 and all(p["bytes"] <= 1000 for p in manifest["pieces"])
    stash = tmp_path / "stash"
    for name in reversed(names):
        assert device_torch.main(["receive", str(out / name), "--stash", str(stash)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"stashed {names[0]}; all pieces here: install"
    assert device_torch.main(["install", "--torch", "9.9.9", "--stash", str(stash)]) == 0
    site = stash / "torch9.9.9" / "site"
    assert capsys.readouterr().out.startswith(f"export PYTHONPATH={site}:")
    assert (site / "torch" / "__init__.py").read_text().startswith("__version__ = '9.9.9'")
    assert (site / "torch" / "lib" / "blob.bin").read_bytes() == BLOB
    assert (site / "triton" / "__init__.py").read_text() == "ok = True\n"
    # a wheel's executables stay executable (Inductor runs triton's ptxas)
    assert (site / "triton" / "backends" / "nvidia" / "bin" / "ptxas").stat().st_mode & 0o111
    assert not (site / "triton" / "__init__.py").stat().st_mode & 0o111


def test_a_missing_piece_is_named_and_install_exits_2(packed, tmp_path, capsys):
    out, manifest = packed
    names = [p["name"] for p in manifest["pieces"]]
    stash = tmp_path / "stash"
    for name in names[1:]:
        device_torch.main(["receive", str(out / name), "--stash", str(stash)])
    capsys.readouterr()
    assert device_torch.main(["install", "--torch", "9.9.9", "--stash", str(stash)]) == 2
    assert capsys.readouterr().err == (f"error: torch 9.9.9: 1 of {len(names)} pieces not received ({names[0]}); "
                                       f"carry each with python tools/device_torch.py receive PIECE\n")


def test_a_corrupt_piece_is_refused_before_it_is_stashed(packed, tmp_path, capsys):
    out, manifest = packed
    piece = out / manifest["pieces"][0]["name"]
    data = bytearray(piece.read_bytes())
    data[10] ^= 0xFF
    piece.write_bytes(bytes(data))
    stash = tmp_path / "stash"
    assert device_torch.main(["receive", str(piece), "--stash", str(stash)]) == 2
    assert capsys.readouterr().err == f"error: {piece} differs from the manifest's SHA-256; carry it again\n"
    assert not (stash / "torch9.9.9" / piece.name).exists()


def test_pack_without_wheels_or_triton_says_what_to_pass(tmp_path, capsys):
    assert device_torch.main(["pack", "--torch", "9.9.9", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: pass --triton (the release torch requires) to download, or --wheels DIR\n"


def test_a_library_bundle_joins_torch_and_the_machine_supplies_the_other_libraries(packed, tmp_path, monkeypatch,
                                                                                  capsys):
    out, manifest = packed
    wheels = tmp_path / "nccl-wheels"
    wheels.mkdir()
    wheel(wheels, "nvidia_nccl-9.9-py3-none-linux.whl", {"nvidia/nccl/lib/libnccl.so.2": "new nccl"})
    assert device_torch.main(["pack", "--name", "nccl9.9", "--wheels", str(wheels), "--out", str(out),
                              "--piece-bytes", "1000"]) == 0
    machine = tmp_path / "machine" / "nvidia"
    for name, text in {"nccl": "old nccl", "cudnn": "machine cudnn"}.items():
        (machine / name / "lib").mkdir(parents=True)
        (machine / name / "lib" / "lib.so").write_text(text)
    monkeypatch.setattr(device_torch, "system_nvidia", lambda: machine)
    stash = tmp_path / "stash"
    for piece in sorted(out.glob("*.part*")):
        assert device_torch.main(["receive", str(piece), "--stash", str(stash)]) == 0
    assert device_torch.main(["install", "--torch", "9.9.9", "--with", "nccl9.9", "--stash", str(stash)]) == 0
    nvidia = stash / "torch9.9.9" / "site" / "nvidia"
    assert (nvidia / "nccl" / "lib" / "libnccl.so.2").read_text() == "new nccl"
    assert not (nvidia / "nccl" / "lib" / "lib.so").exists()
    assert (nvidia / "cudnn").resolve() == (machine / "cudnn").resolve()
    assert (nvidia / "cudnn" / "lib" / "lib.so").read_text() == "machine cudnn"
    assert (stash / "torch9.9.9" / "site" / "torch" / "lib" / "blob.bin").read_bytes() == BLOB
    # a second install (the next call on a warm machine) unpacks nothing again and says the same
    capsys.readouterr()
    assert device_torch.main(["install", "--torch", "9.9.9", "--with", "nccl9.9", "--stash", str(stash)]) == 0
    assert capsys.readouterr().out.startswith(f"export PYTHONPATH={nvidia.parent}:")


def test_a_named_bundle_never_received_is_one_line(packed, tmp_path, capsys):
    out, manifest = packed
    stash = tmp_path / "stash"
    for piece in manifest["pieces"]:
        device_torch.main(["receive", str(out / piece["name"]), "--stash", str(stash)])
    capsys.readouterr()
    assert device_torch.main(["install", "--torch", "9.9.9", "--with", "nccl9.9", "--stash", str(stash)]) == 2
    assert capsys.readouterr().err == ("error: nccl9.9: no piece received; carry each with "
                                       "python tools/device_torch.py receive PIECE\n")


def test_the_machines_packages_built_for_another_torch_are_named_with_what_to_do(monkeypatch):
    pins = {"torchaudio": ("2.11.0", ["torch==2.11.0"]), "torchvision": ("0.30.0", ["torch==2.15.0", "numpy"])}

    def requires(package):
        if package not in pins:
            raise device_torch.importlib.metadata.PackageNotFoundError(package)
        return pins[package][1]

    monkeypatch.setattr(device_torch.importlib.metadata, "requires", requires)
    monkeypatch.setattr(device_torch.importlib.metadata, "version", lambda package: pins[package][0])
    assert device_torch.mismatched_companions("2.15.0", ("torchaudio", "torchvision", "absent")) == [
        "this machine's torchaudio 2.11.0 is built for torch 2.11.0, not 2.15.0: if importing it fails "
        "(transformers does), python3 -m pip uninstall -y torchaudio, or carry the torchaudio of torch 2.15.0"]
    assert device_torch.mismatched_companions("2.11.0", ("torchaudio",)) == []
