"""Images as local environments: a bin folder, plus the ENV and CMD of the image's Dockerfile.

An image that is not mapped cannot be pulled: the pod reports ErrImagePull, then
ImagePullBackOff, as on a cluster whose registry lacks the tag.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from .podspec import Image


def dockerfile_defaults(text: str) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """ENV, ENTRYPOINT and CMD of a Dockerfile's last stage (the image that ships)."""
    stage = text.split("\nFROM ")[-1]
    lines = stage.replace("\\\n", " ").splitlines()
    env: dict[str, str] = {}
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    for line in lines:
        word, _, rest = line.strip().partition(" ")
        if word == "ENV":
            for item in shlex.split(rest):
                if "=" in item:
                    key, _, value = item.partition("=")
                    env[key] = value
        elif word in ("CMD", "ENTRYPOINT"):
            rest = rest.strip()
            value = tuple(json.loads(rest)) if rest.startswith("[") else ("/bin/sh", "-c", rest)
            if word == "CMD":
                cmd = value
            else:
                entrypoint = value
    return env, entrypoint, cmd


def image_from(ref: str, environment: Path, dockerfile: Path) -> Image:
    env, entrypoint, cmd = dockerfile_defaults(dockerfile.read_text())
    return Image(ref=ref, bin_dir=str(environment / "bin"), entrypoint=entrypoint, cmd=cmd,
                 env=tuple(sorted(env.items())))
