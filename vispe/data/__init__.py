"""LightningDataModules for vispe: one :class:`ImageDataModule` over any image data set (an :class:`ImageSource`:
CIFAR-10 zips, Fashion-MNIST, digits, ImageFolder trees, torchvision sets, generated images), Three Cell, NIAH and
video-text data.

Every DataModule takes its data location from an argument or ``$VISPE_DATA_ROOT`` and fails at
construction, naming the missing path, when the files are not there.
"""
from .loading import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, EpochSeededRandomSampler, ResumableDataLoader, resolve_data_path
from .image_datamodule import (AUGMENTATIONS, ImageDataModule, ImageSource, LazyImageDataset, TensorImageDataset,
                               normalize_images, random_crop_flip, resize_images)
from .image import (
    CIFAR10_CLASSES,
    CIFAR10Images,
    CIFAR10JpegDataModule,
    CIFAR10Zip,
    DigitsDataModule,
    DigitsImages,
    FashionMNISTDataModule,
    FashionMNISTImages,
    FolderImages,
    ImageFolderDataModule,
    SyntheticDataModule,
    SyntheticImages,
    TorchvisionDataModule,
    TorchvisionImages,
    load_cifar10_zip,
    read_idx,
)
from .niah import NIAHDataModule, NIAHDataset, NIAHVocab
from .three_cell import ThreeCellDataModule, ThreeCellDataset, generate_three_cell, three_cell_labels
from .video_text import (
    SyntheticVideoTextDataModule,
    SyntheticVideoTextSpec,
    VideoReadError,
    VideoTextDataModule,
    VideoTextDataset,
    collate_video_text,
    generate_video_text_set,
    load_manifest,
    read_video,
    write_video,
)

__all__ = [
    "NIAHDataModule",
    "NIAHDataset",
    "NIAHVocab",
    "ThreeCellDataModule",
    "ThreeCellDataset",
    "generate_three_cell",
    "three_cell_labels",
    "SyntheticVideoTextDataModule",
    "SyntheticVideoTextSpec",
    "VideoReadError",
    "VideoTextDataModule",
    "VideoTextDataset",
    "collate_video_text",
    "generate_video_text_set",
    "load_manifest",
    "read_video",
    "write_video",
    "AUGMENTATIONS",
    "DATA_ROOT_ENV",
    "DEFAULT_DATA_ROOT",
    "CIFAR10_CLASSES",
    "CIFAR10Images",
    "CIFAR10Zip",
    "CIFAR10JpegDataModule",
    "DigitsDataModule",
    "DigitsImages",
    "EpochSeededRandomSampler",
    "ResumableDataLoader",
    "FashionMNISTDataModule",
    "FashionMNISTImages",
    "FolderImages",
    "ImageDataModule",
    "ImageFolderDataModule",
    "ImageSource",
    "SyntheticDataModule",
    "SyntheticImages",
    "LazyImageDataset",
    "TensorImageDataset",
    "TorchvisionDataModule",
    "TorchvisionImages",
    "load_cifar10_zip",
    "random_crop_flip",
    "read_idx",
    "normalize_images",
    "resize_images",
    "resolve_data_path",
]
