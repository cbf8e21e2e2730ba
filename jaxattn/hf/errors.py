"""The one error of the Hugging Face interop that is not a plain bad input."""


class UnsupportedCheckpoint(ValueError):
    """A checkpoint or config jaxattn cannot reproduce exactly.

    Raised for an architecture that is not supported, or a feature of a
    supported one that jaxattn does not implement (the message names the
    architecture or the config field); and, when exporting, for a
    `ModelConfig` that no transformers architecture reproduces (the message
    names the field that prevents it). Raised before any tensor is read or
    written.
    """
