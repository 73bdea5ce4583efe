"""FastDeploy's other import path for the ERNIE-4.5 tokenizer (`Ernie4_5Tokenizer`); the same class."""
from __future__ import annotations

from fastdeploy.input.ernie_tokenizer import Ernie4_5Tokenizer

__all__ = ["Ernie4_5Tokenizer"]
