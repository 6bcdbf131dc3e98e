"""The compiled parts of labrun: JPEG region decoding (src/labrun/data/image/_jpeg_region.c) and
the top rows of a mask PNG (src/labrun/data/segmentation/_png_rows.c).

Everything else is in pyproject.toml. Both extensions are optional: without a C compiler or the
libraries' headers (Debian: libjpeg62-turbo-dev, libpng-dev) the install still succeeds, and
labrun decodes whole JPEGs and masks instead, which gives the same pixels more slowly.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("labrun.data.image._jpeg_region", ["src/labrun/data/image/_jpeg_region.c"],
              libraries=["jpeg"], optional=True),
    Extension("labrun.data.segmentation._png_rows", ["src/labrun/data/segmentation/_png_rows.c"],
              libraries=["png"], optional=True),
])
