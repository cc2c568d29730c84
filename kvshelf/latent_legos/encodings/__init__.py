"""Family encodings of latent state: affine and TurboQuant."""

from .affine import AffineEncoding
from .family import FamilyEncoding, TurboKeyEncoding, family_encoding

__all__ = ["AffineEncoding", "FamilyEncoding", "TurboKeyEncoding", "family_encoding"]
