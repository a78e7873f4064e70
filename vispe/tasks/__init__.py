"""Lightning tasks. Tasks drive models; models drive their positional encodings (tasks never touch one)."""
from .auxiliary import add_auxiliary_loss, check_aux_loss_weight
from .backbone import Backbone, build_model, resolve_backbone
from .classification import ImageClassification
from .optim import adamw_warmup_cosine, param_groups_no_decay, warmup_cosine
from .niah import VideoNIAH
from .retrieval import VideoTextRetrieval, retrieval_metrics
from .three_cell import ThreeCellTask

__all__ = [
    "Backbone",
    "ImageClassification",
    "ThreeCellTask",
    "VideoTextRetrieval",
    "VideoNIAH",
    "adamw_warmup_cosine",
    "add_auxiliary_loss",
    "check_aux_loss_weight",
    "build_model",
    "param_groups_no_decay",
    "resolve_backbone",
    "retrieval_metrics",
    "warmup_cosine",
]
