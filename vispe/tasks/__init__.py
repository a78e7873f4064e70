"""Lightning tasks. Tasks drive models; models drive their positional encodings (tasks never touch one)."""
from .classification import ImageClassification, build_model
from .optim import adamw_warmup_cosine, param_groups_no_decay, warmup_cosine
from .niah import VideoNIAH
from .retrieval import VideoTextRetrieval, retrieval_metrics
from .three_cell import ThreeCellTask

__all__ = [
    "ImageClassification",
    "ThreeCellTask",
    "VideoTextRetrieval",
    "VideoNIAH",
    "adamw_warmup_cosine",
    "build_model",
    "param_groups_no_decay",
    "retrieval_metrics",
    "warmup_cosine",
]
