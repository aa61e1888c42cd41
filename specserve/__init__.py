"""specserve: an LLM inference engine built around lossless speculative decoding."""
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name):  # import the engine lazily: `import specserve` stays cheap for the CLI
    if name == "LLM":
        from specserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
