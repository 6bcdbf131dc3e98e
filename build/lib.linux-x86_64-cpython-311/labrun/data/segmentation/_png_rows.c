/* Decode the top rows of an 8-bit grey or palette PNG (a segmentation mask) with libpng.

   decode_rows(data, stop) -> (pixels: bytearray, width: int), or None

   `pixels` holds rows 0..stop-1, one byte per pixel: grey values or palette indices as stored,
   never expanded to colours. A training crop needs the rows down to its bottom: every row
   above it must still be inflated and unfiltered (each row is filtered against the one above),
   but the rows below it never are.

   zlib's Adler-32 of the inflated rows is not verified (PNG_IGNORE_ADLER32): the chunk CRCs,
   which libpng still checks, already cover every compressed byte, and the checksum took 0.25 ms
   of a 1024x768 mask's 1.6 ms here.

   None means the file is not what this decodes (16-bit, colour, interlaced) or is damaged: the
   caller then decodes it the usual way (masks.decode_mask), which reads or refuses it with a
   message naming the file.

   Why not torchvision's decode_png or Pillow: both decode every row, with the checksum. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <png.h>
#include <setjmp.h>
#include <string.h>

struct source {
    const unsigned char *data;
    size_t size, pos;
};

static void read_from_memory(png_structp png, png_bytep out, size_t count) {
    struct source *source = (struct source *)png_get_io_ptr(png);
    if (count > source->size - source->pos)
        png_error(png, "file cut short");
    memcpy(out, source->data + source->pos, count);
    source->pos += count;
}

static void quiet(png_structp png, png_const_charp message) {
    (void)png;
    (void)message; /* a warning leaves the pixels intact; nothing goes to stderr */
}

static void on_error(png_structp png, png_const_charp message) {
    (void)message;
    png_longjmp(png, 1);
}

static PyObject *decode_rows(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer data;
    int stop;
    if (!PyArg_ParseTuple(args, "y*i", &data, &stop))
        return NULL;

    struct source source = {(const unsigned char *)data.buf, (size_t)data.len, 0};
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, NULL, on_error, quiet);
    png_infop info = png == NULL ? NULL : png_create_info_struct(png);
    /* volatile: assigned after setjmp, read after longjmp */
    PyObject *volatile pixels = NULL;
    volatile int readable = 0;
    png_uint_32 width = 0, height = 0;
    int colour = 0;
    if (info == NULL)
        goto done;
    /* The GIL stays held: a longjmp out of a released section could not take it back, and
       each DataLoader worker decodes in one thread anyway. */
    if (setjmp(png_jmpbuf(png)))
        goto done;
#ifdef PNG_IGNORE_ADLER32
    png_set_option(png, PNG_IGNORE_ADLER32, PNG_OPTION_ON);
#endif
    png_set_read_fn(png, &source, read_from_memory);
    png_read_info(png, info);
    width = png_get_image_width(png, info);
    height = png_get_image_height(png, info);
    colour = png_get_color_type(png, info);
    if (png_get_bit_depth(png, info) != 8 ||
        png_get_interlace_type(png, info) != PNG_INTERLACE_NONE ||
        (colour != PNG_COLOR_TYPE_GRAY && colour != PNG_COLOR_TYPE_PALETTE) ||
        stop <= 0 || (png_uint_32)stop > height)
        goto done;
    pixels = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)width * stop);
    if (pixels == NULL)
        goto done;
    unsigned char *out = (unsigned char *)PyByteArray_AS_STRING(pixels);
    for (int row = 0; row < stop; row++)
        png_read_row(png, out + (size_t)row * width, NULL);
    readable = 1;

done:
    png_destroy_read_struct(&png, &info, NULL);
    PyBuffer_Release(&data);
    if (!readable) {
        Py_XDECREF(pixels);
        if (PyErr_Occurred()) /* out of memory */
            return NULL;
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nk)", pixels, (unsigned long)width);
}

static PyMethodDef methods[] = {
    {"decode_rows", decode_rows, METH_VARARGS,
     "decode_rows(data, stop) -> (bytearray, width) or None: rows 0..stop-1 of an 8-bit grey "
     "or palette PNG, a byte a pixel (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, .m_name = "_png_rows", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__png_rows(void) { return PyModule_Create(&definition); }
