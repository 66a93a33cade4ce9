//! Exact CPU codecs for every storage format the kernels read or write.
