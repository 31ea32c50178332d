"""kohya / musubi-tuner folder datasets: media files beside same-name caption files.

A folder ``imgs/`` with ``cat.png`` + ``cat.txt`` becomes rows ``{"image": "cat.png", "prompt":
<cat.txt>}`` (paths relative to the folder).  The rules follow musubi-tuner
(src/musubi_tuner/dataset/media_utils.py ``glob_images``/``glob_videos``, datasources.py
``ImageDirectoryDatasource``/``VideoDirectoryDatasource``): media directly in the folder (not in
subfolders) with its extensions; an image without a caption file is left out (musubi lists only
captioned images; we say how many in one line); a caption is the file's text, stripped.

kohya sd-scripts' DreamBooth layout is read too: a folder whose subfolders are named
``<repeats>_<name>`` (``10_sks dog``) gives one source per subfolder, repeated that many times,
and an image without a caption file there is captioned with ``<name>`` (the class tokens).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffsynth_core.data import DatasetError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".avif")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".avi", ".mkv", ".mov", ".flv", ".wmv", ".m4v", ".mpg", ".mpeg")
REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")


@dataclass
class FolderSource:
    folder: Path
    records: list[dict[str, Any]]
    repeat: int = 1


def _media(folder: Path) -> list[tuple[Path, str]]:
    found = []
    for path in sorted(folder.iterdir()):
        suffix = path.suffix.lower()
        if path.is_file() and suffix in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS:
            found.append((path, "image" if suffix in IMAGE_EXTENSIONS else "video"))
    return found


def folder_records(folder: Path, media: list[tuple[Path, str]], caption_extension: str,
                   class_tokens: str | None = None) -> list[dict[str, Any]]:
    """Rows for the captioned ``media`` (``_media(folder)``); an uncaptioned video is an error naming it."""
    records, uncaptioned = [], []
    for path, kind in media:
        caption_file = path.with_suffix(caption_extension)
        if caption_file.is_file():
            try:
                caption = caption_file.read_text(encoding="utf-8-sig").strip()
            except UnicodeDecodeError:
                raise DatasetError("caption file is not UTF-8 text: save it as UTF-8", metadata=folder,
                                   file=caption_file) from None
        elif class_tokens is not None:
            caption = class_tokens
        elif kind == "image":
            uncaptioned.append(path.name)
            continue
        else:
            raise DatasetError(f"video has no caption file {caption_file.name}", metadata=folder, file=path)
        records.append({kind: path.name, "prompt": caption})
    if uncaptioned:
        log.warning("%s: %d images without a %s caption left out (as musubi-tuner does), e.g. %s",
                    folder, len(uncaptioned), caption_extension, uncaptioned[0])
    if not records:
        raise DatasetError(f"no captioned images or videos (caption files *{caption_extension}; "
                           f"set dataset.caption_extension if yours differ)", metadata=folder)
    return records


def folder_sources(folder: Path, caption_extension: str) -> list[FolderSource]:
    """The folder itself, or its ``<repeats>_<name>`` subfolders when it holds no media of its own."""
    folder = Path(folder)
    media = _media(folder)
    if media:
        return [FolderSource(folder, folder_records(folder, media, caption_extension))]
    subfolders = [(p, REPEAT_FOLDER.match(p.name)) for p in sorted(folder.iterdir()) if p.is_dir()]
    sources = [FolderSource(p, folder_records(p, _media(p), caption_extension, class_tokens=m.group(2)),
                            int(m.group(1)))
               for p, m in subfolders if m and int(m.group(1)) > 0]
    if not sources:
        raise DatasetError("no images or videos, and no <repeats>_<name> subfolders with them", metadata=folder)
    return sources
