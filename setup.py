"""The one compiled part of labrun: JPEG region decoding (src/labrun/data/image/_jpeg_region.c).

Everything else is in pyproject.toml. The extension is optional: without a C compiler or
libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev) the install still succeeds, and labrun
decodes whole JPEGs and crops them instead, which gives the same pixels more slowly.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("labrun.data.image._jpeg_region", ["src/labrun/data/image/_jpeg_region.c"],
                             libraries=["jpeg"], optional=True)])
