"""The Objective-C++ host (csrc/backends/metal/device_metal.mm) compiled as Apple's toolchain would, by
scripts/check-objc: against the project's declaration headers (tools/apple-decls/, always), and against Apple's
SDK headers with those headers verified against the SDK's declarations when $LILY_APPLE_SDK names an extracted
SDK (/work/shared/tools/apple-sdk/extract.sh). Zero diagnostics in each; seeded mistakes must fail."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check-objc"
SDK = os.environ.get("LILY_APPLE_SDK")
CLANG = os.environ.get("LILY_CLANGXX") or shutil.which("clang++-19") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(not CLANG, reason="no clang++: the Objective-C++ check needs clang (>= 17)")
needs_sdk = pytest.mark.skipif(not SDK, reason="$LILY_APPLE_SDK is not set (an extracted Apple SDK; "
                               "/work/shared/tools/apple-sdk/extract.sh makes one)")


def check(*args, env=None):
    r = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    return r.returncode, r.stdout + r.stderr


# Two mistakes Apple's compiler rejects: issue 11's ARC error (a reference to a strong id without an ownership
# qualifier) and a misspelt selector (ARC makes an unknown selector an error).
ARC_MISTAKE = """#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <vector>
id<MTLComputePipelineState> first(std::vector<id<MTLComputePipelineState>>& v) {
  id<MTLComputePipelineState>& p = v[0];
  return p;
}
"""
SELECTOR_MISTAKE = """#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
id<MTLBuffer> make(id<MTLDevice> d) { return [d newBufferWithLength:16 option:MTLResourceStorageModeShared]; }
"""


def test_mm_compiles_against_declaration_headers():
    rc, out = check("decl")
    assert rc == 0 and "decl: ok" in out, out


@pytest.mark.parametrize("mode", ["decl", pytest.param("sdk", marks=needs_sdk)])
@pytest.mark.parametrize("source,message", [
    (ARC_MISTAKE, "no explicit ownership"),
    (SELECTOR_MISTAKE, "newBufferWithLength:option:"),
])
def test_mistakes_fail(tmp_path, mode, source, message):
    mm = tmp_path / "mistake.mm"
    mm.write_text(source)
    rc, out = check(mode, mm)
    assert rc == 1 and message in out, out


@needs_sdk
def test_mm_compiles_against_apple_sdk():
    rc, out = check("sdk")
    assert rc == 0 and "sdk: ok" in out, out


@needs_sdk
def test_declaration_headers_match_the_sdk():
    rc, out = check("verify")
    assert rc == 0 and "verify: ok" in out, out


@needs_sdk
@pytest.mark.parametrize("old,new,finding", [
    # nullability of a return type
    ("- (nullable id <MTLCommandBuffer>)commandBuffer;", "- (id <MTLCommandBuffer>)commandBuffer;", "-commandBuffer"),
    # a property attribute
    ("@property (readonly, copy) NSString *localizedDescription;", "@property (readonly) NSString *localizedDescription;",
     ".localizedDescription"),
    # an enumerator's value
    ("MTLCommandBufferStatusError = 5,", "MTLCommandBufferStatusError = 4,", "MTLCommandBufferStatusError"),
])
def test_verify_finds_a_wrong_declaration(tmp_path, old, new, finding):
    decls = tmp_path / "apple-decls"
    shutil.copytree(ROOT / "tools" / "apple-decls", decls)
    for h in decls.rglob("*.h"):
        text = h.read_text()
        if old in text:
            h.write_text(text.replace(old, new))
            break
    else:
        pytest.fail(f"{old!r} is not in tools/apple-decls")
    rc, out = check("verify", env={"LILY_APPLE_DECLS": str(decls)})
    assert rc == 1 and finding in out, out
