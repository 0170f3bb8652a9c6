"""Compiles one Encore CUDA kernel for sm_90 with NVRTC, here, without a GPU,
and reports what ptxas made of it: registers, stack, spills, instructions,
and with --sass the machine code (SASS).

Used by scripts/kernel-info.sh, which fetches the tools and the sources.

  kernel_info.py TOOLS SOURCE.cu [--sass] [WORD...]

WORDs are the 32-bit words of a value argument (decimal or 0x hex), as a
graph specializes a kernel for its node's shape (`ENCORE_VALUE_WORDS`);
without them the kernel's generic code is compiled. The kernel's own
compile options come from SOURCE.options (one a line) where it exists.
"""
import ctypes
import glob
import os
import subprocess
import sys
import tempfile


def main():
    tools, source = sys.argv[1], sys.argv[2]
    args = sys.argv[3:]
    sass = "--sass" in args
    words = [w for w in args if w != "--sass"]
    nvrtc = ctypes.CDLL(glob.glob(os.path.join(tools, "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"))[0])
    prog = ctypes.c_void_p()
    text = open(source, "rb").read()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text, b"kernel.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v"]
    options = os.path.splitext(source)[0] + ".options"
    if os.path.exists(options):
        opts += [line.strip().encode() for line in open(options) if line.strip()]
    if words:
        value = ",".join(hex(int(w, 0)) + "u" for w in words)
        opts.append(("--define-macro=ENCORE_VALUE_WORDS={" + value + "}").encode())
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    print(log.value.decode().strip())
    if status != 0:
        sys.exit(f"compile failed (NVRTC status {status})")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin.raw)
        f.flush()
        cuobjdump = glob.glob(os.path.join(tools, "nvidia/*/bin/cuobjdump"))[0]
        run = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True)
        out = run.stdout
        if run.returncode != 0:
            sys.exit(f"cuobjdump failed: {run.stderr.strip()}")
    stripped = (line.strip() for line in out.splitlines())
    lines = [line for line in stripped if line.startswith("/*") and "*/" in line[:10]]
    print(f"cubin {size.value} bytes, {len(lines)} instructions")
    if sass:
        print(out)


if __name__ == "__main__":
    main()
