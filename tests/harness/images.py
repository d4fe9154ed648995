"""Container images built on the machine, without a registry: each a single-layer OCI image archive
that `ctr images import` reads, named so that pods use it with imagePullPolicy IfNotPresent."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAUSE_IMAGE = "gpuguard.test/pause:1"
BUSYBOX_IMAGE = "gpuguard.test/busybox:1"
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: one static binary, every tool of the test image
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class Image:
    name: str
    archive: Path


def _blob(blobs: dict[str, bytes], data: bytes) -> str:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    blobs[digest] = data
    return digest


def _layer(files: Mapping[str, Path], links: Mapping[str, str]) -> bytes:
    """An uncompressed tar of `files` (path in the image -> file on the machine) and symlinks.
    Owners and times are zeroed, so the same inputs give the same digest."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directories = sorted({str(Path(p).parent) for p in [*files, *links]} - {"/", "."})
        for directory in directories:
            info = tarfile.TarInfo(directory.lstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, source in sorted(files.items()):
            data = source.read_bytes()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
        for path, target in sorted(links.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buffer.getvalue()


def write_image(
    name: str,
    archive: Path,
    files: Mapping[str, Path],
    *,
    links: Mapping[str, str] | None = None,
    entrypoint: Sequence[str] = (),
    env: Sequence[str] = (),
) -> Image:
    """Writes the OCI image layout of one image (`oci-layout`, `index.json`, `blobs/`) as a tar."""
    blobs: dict[str, bytes] = {}
    layer = _layer(files, links or {})
    layer_digest = _blob(blobs, layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Env": list(env)},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},  # uncompressed: digest = diff id
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": _blob(blobs, config_bytes),
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": layer_digest, "size": len(layer)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    index: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": manifest["mediaType"],
                "digest": _blob(blobs, manifest_bytes),
                "size": len(manifest_bytes),
                # The name containerd gives the image on import.
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                },
            }
        ],
    }
    entries = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
        **{f"blobs/sha256/{digest.removeprefix('sha256:')}": data for digest, data in blobs.items()},
    }
    with tarfile.open(archive, "w") as tar:
        for path, data in entries.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return Image(name, archive)


def busybox_applets(busybox: Path = BUSYBOX) -> list[str]:
    """The tools this busybox provides (`busybox --list`)."""
    listing = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True)
    return listing.stdout.split()


def build_images(runtime_bin: Path, directory: Path) -> list[Image]:
    """The sandbox image (the static pause) and the test image (busybox with every applet linked)."""
    directory.mkdir(parents=True, exist_ok=True)
    pause = write_image(
        PAUSE_IMAGE, directory / "pause.tar", {"/pause": runtime_bin / "pause"}, entrypoint=["/pause"]
    )
    links = {f"/bin/{applet}": "busybox" for applet in busybox_applets() if applet != "busybox"}
    busybox = write_image(
        BUSYBOX_IMAGE,
        directory / "busybox.tar",
        {"/bin/busybox": BUSYBOX},
        links=links,
        entrypoint=["/bin/sh"],
        env=["PATH=/bin"],
    )
    return [pause, busybox]
