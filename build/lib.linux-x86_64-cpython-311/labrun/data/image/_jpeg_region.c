/* Decode one rectangle of a JPEG with libjpeg-turbo, skipping the work outside it.

   decode_region(data, top, left, height, width, scale_denom)
       -> (pixels: bytearray, row_start: int, row_width: int), or None

   The rectangle is in the coordinates of the image decoded at 1/scale_denom (1, 2, 4 or 8).
   The result holds `height` rows of `row_width` RGB pixels starting at column `row_start`: a
   little wider than asked, because libjpeg-turbo crops rows at block boundaries. Rows above the
   rectangle are entropy-decoded but not transformed (jpeg_skip_scanlines), rows below it are
   never read, and only the columns it covers are transformed (jpeg_crop_scanline). The pixels
   equal those of a full decode (TurboJPEG's defaults: accurate DCT, smooth chroma upsampling).

   None means libjpeg-turbo warned about damaged data (it would have filled in grey): the caller
   then decodes the whole file the usual way, where Pillow decides whether it is readable.

   Why not TurboJPEG: its 2.x API (Debian 12's libturbojpeg0) decodes whole images only;
   tj3SetCroppingRegion arrived in libjpeg-turbo 3.0. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <jpeglib.h>

struct error_manager {
    struct jpeg_error_mgr pub;
    jmp_buf escape;
};

static void on_error(j_common_ptr cinfo) {
    longjmp(((struct error_manager *)cinfo->err)->escape, 1);
}

static void quiet(j_common_ptr cinfo) {
    (void)cinfo; /* warnings are counted in num_warnings; never printed to stderr */
}

static PyObject *decode_region(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer data;
    int top, left, height, width, scale_denom;
    if (!PyArg_ParseTuple(args, "y*iiiii", &data, &top, &left, &height, &width, &scale_denom))
        return NULL;

    struct jpeg_decompress_struct cinfo;
    struct error_manager err;
    char message[JMSG_LENGTH_MAX] = "";
    PyObject *volatile pixels = NULL; /* volatile: assigned after setjmp, read after longjmp */
    const char *problem = NULL;
    JDIMENSION row_start = 0, row_width = 0;
    int warnings = 0;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.output_message = quiet;
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.escape)) {
        (*cinfo.err->format_message)((j_common_ptr)&cinfo, message);
        problem = message;
        goto done;
    }
    jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = scale_denom;
    jpeg_start_decompress(&cinfo);
    if (top < 0 || left < 0 || height <= 0 || width <= 0 ||
        (JDIMENSION)top + height > cinfo.output_height ||
        (JDIMENSION)left + width > cinfo.output_width) {
        problem = "region outside the image";
        goto done;
    }
    /* One extra column each side: smooth upsampling reads its neighbours, and at the edge of a
       crop it would see a replicated edge instead, so the outer columns would differ. */
    JDIMENSION right = (JDIMENSION)(left + width) + 1;
    if (right > cinfo.output_width)
        right = cinfo.output_width;
    row_start = left > 0 ? (JDIMENSION)left - 1 : 0;
    row_width = right - row_start;
    jpeg_crop_scanline(&cinfo, &row_start, &row_width);

    Py_ssize_t stride = (Py_ssize_t)row_width * 3;
    pixels = PyByteArray_FromStringAndSize(NULL, stride * height);
    if (pixels == NULL)
        goto done;
    unsigned char *out = (unsigned char *)PyByteArray_AS_STRING(pixels);
    /* The GIL stays held: a longjmp out of a released section could not take it back, and
       each DataLoader worker decodes in one thread anyway. */
    if (top > 0)
        jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
    for (int row = 0; row < height; row++) {
        JSAMPROW line = out + row * stride;
        jpeg_read_scanlines(&cinfo, &line, 1);
    }
    warnings = (int)err.pub.num_warnings;

done:
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    if (problem != NULL) {
        Py_XDECREF(pixels);
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    if (pixels == NULL)
        return NULL;
    if (warnings) {
        Py_DECREF(pixels);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nii)", pixels, (int)row_start, (int)row_width);
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, top, left, height, width, scale_denom) -> (bytearray, row_start, "
     "row_width) or None: RGB rows of one rectangle of a JPEG (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, .m_name = "_jpeg_region", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__jpeg_region(void) { return PyModule_Create(&definition); }
