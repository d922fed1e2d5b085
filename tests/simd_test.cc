// placeholder: replaced by the SIMD-vs-reference test
