/* Host Huffman decoding of a run of JPEGs in one native call (nvjpeg.HostHuffmanDecoder).
 *
 * nvJPEG's decoupled phases take four library calls per image. Made from Python through ctypes,
 * each call hands the interpreter lock back and takes it again; a dozen threads doing that beside
 * the Loader's own threads spend their time waiting for the lock. Here a thread makes one call per
 * run of images and holds no lock while it decodes.
 *
 * The library's functions come in as pointers (from the libnvjpeg that gdsdata loaded), so this file
 * needs neither nvJPEG's headers nor its library at build time. It is built as an (otherwise empty)
 * extension module so that setuptools compiles it; gdsdata loads it with ctypes.
 *
 * Each image k of a run uses slot k: its own decoder state, with its own pinned and device buffers
 * attached once, and its own parsed-stream object. All host phases run first, then the transfers
 * and device phases are queued on `stream`, so the thread never waits for the GPU here. The caller
 * makes sure the previous run's queued work has finished before a slot is used again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    unsigned char *channel[4];
    size_t pitch[4];
} gds_image_t; /* nvjpegImage_t of CUDA 13's nvJPEG */

typedef struct {
    unsigned char *channel[4];
    unsigned int pitch[4];
} gds_image12_t; /* nvjpegImage_t of CUDA 12's */

typedef int (*parse_fn)(void *handle, const unsigned char *data, size_t length, int save_metadata,
                        int save_stream, void *jpeg_stream);
typedef int (*host_fn)(void *handle, void *decoder, void *state, void *params, void *jpeg_stream);
typedef int (*transfer_fn)(void *handle, void *decoder, void *state, void *jpeg_stream, void *stream);
typedef int (*device_fn)(void *handle, void *decoder, void *state, void *destination, void *stream);

typedef struct {
    parse_fn parse;       /* nvjpegJpegStreamParse */
    host_fn host;         /* nvjpegDecodeJpegHost */
    transfer_fn transfer; /* nvjpegDecodeJpegTransferToDevice */
    device_fn device;     /* nvjpegDecodeJpegDevice */
} gds_nvjpeg_fns;

/* Decode images 0..n-1 (n <= the number of slots) into RGB interleaved buffers outs[k] of row pitch
 * pitches[k]. status[k]: 0 if image k was decoded, else 1000 * phase + nvJPEG's status (phase 1
 * parse, 2 host, 3 transfer, 4 device). pitch32: the library's nvjpegImage_t has CUDA 12's 32-bit
 * pitches. Returns the number of failed images. */
int gds_host_decode(const gds_nvjpeg_fns *fns, void *handle, void *decoder, void *params,
                    void *const *states, void *const *jpeg_streams, const uint64_t *data,
                    const uint64_t *lengths, const uint64_t *outs, const uint64_t *pitches, int n,
                    void *stream, int pitch32, int32_t *status) {
    int failed = 0;
    for (int k = 0; k < n; k++) {
        int s = fns->parse(handle, (const unsigned char *)(uintptr_t)data[k], (size_t)lengths[k], 0, 0,
                           jpeg_streams[k]);
        if (s == 0) {
            s = fns->host(handle, decoder, states[k], params, jpeg_streams[k]);
            status[k] = s ? 2000 + s : 0;
        } else {
            status[k] = 1000 + s;
        }
    }
    for (int k = 0; k < n; k++) {
        if (status[k] == 0) {
            gds_image_t image = {{0}, {0}};
            gds_image12_t image12 = {{0}, {0}};
            image.channel[0] = image12.channel[0] = (unsigned char *)(uintptr_t)outs[k];
            image.pitch[0] = (size_t)pitches[k];
            image12.pitch[0] = (unsigned int)pitches[k];
            void *destination = pitch32 ? (void *)&image12 : (void *)&image;
            int s = fns->transfer(handle, decoder, states[k], jpeg_streams[k], stream);
            if (s) {
                status[k] = 3000 + s;
            } else if ((s = fns->device(handle, decoder, states[k], destination, stream)) != 0) {
                status[k] = 4000 + s;
            }
        }
        failed += status[k] != 0;
    }
    return failed;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hostdecode",
                                    "gdsdata's native host Huffman loop (loaded with ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__hostdecode(void) { return PyModule_Create(&module); }
