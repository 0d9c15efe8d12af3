// The project's declaration header for Metal: only what csrc/backends/metal/device_metal.mm uses, with Apple's
// signatures, ownership and nullability, in the headers and categories Apple declares them in (MTLTypes.h,
// MTLResource.h, MTLBuffer.h, MTLLibrary.h, MTLDevice.h, MTLCommandQueue.h, MTLCommandBuffer.h,
// MTLCommandEncoder.h, MTLComputeCommandEncoder.h, MTLComputePipeline.h), as of the iPhoneOS 17.4 SDK; what
// that SDK predates comes from lily_newer_than_sdk.h and lily_newer_methods.h in both compiles. See Foundation/Foundation.h.
#pragma once
#import <Foundation/Foundation.h>

#define MTL_EXTERN extern "C"
#define MTL_INLINE static inline

NS_ASSUME_NONNULL_BEGIN

@protocol MTLDevice;

// MTLTypes.h
typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

MTL_INLINE MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

// MTLResource.h
typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
  MTLResourceStorageModeShared = 0ul << 4,
};

@protocol MTLResource <NSObject>
@property (nullable, copy, atomic) NSString *label;
@end

// MTLBuffer.h
@protocol MTLBuffer <MTLResource>
@property (readonly) NSUInteger length;
- (void*)contents NS_RETURNS_INNER_POINTER;
@end

// MTLLibrary.h
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
  MTLLanguageVersion3_1 = (3 << 16) + 1,
};

@protocol MTLFunction <NSObject>
@end

@interface MTLCompileOptions : NSObject <NSCopying>
@property (readwrite, nonatomic) BOOL fastMathEnabled;
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

@protocol MTLLibrary <NSObject>
- (nullable id <MTLFunction>) newFunctionWithName:(NSString *)functionName;
@property (readonly) NSArray <NSString *> *functionNames;
@end

// MTLComputePipeline.h
@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end

// MTLCommandEncoder.h
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
  MTLBarrierScopeBuffers = 1 << 0,
};

@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

// MTLComputeCommandEncoder.h
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id <MTLComputePipelineState>)state;
- (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id <MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
-(void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end

// MTLCommandBuffer.h
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
  MTLCommandBufferStatusError = 5,
};

typedef NS_ENUM(NSUInteger, MTLDispatchType) {
  MTLDispatchTypeSerial,
  MTLDispatchTypeConcurrent,
};

@protocol MTLCommandBuffer <NSObject>
- (void)commit;
- (void)waitUntilCompleted;
@property (readonly) MTLCommandBufferStatus status;
@property (nullable, readonly) NSError *error;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType) dispatchType;
@end

// MTLCommandQueue.h
@protocol MTLCommandQueue <NSObject>
- (nullable id <MTLCommandBuffer>)commandBuffer;
@end

// MTLDevice.h
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
  MTLGPUFamilyMetal3 = 5001,
};

MTL_EXTERN id <MTLDevice> __nullable MTLCreateSystemDefaultDevice(void) NS_RETURNS_RETAINED;

@interface MTLArchitecture : NSObject <NSCopying>
@property (readonly, nonnull) NSString *name;
@end

@protocol MTLDevice <NSObject>
@property (nonnull, readonly) NSString *name;
@property (nonnull, readonly) MTLArchitecture *architecture;
@property (readonly) uint64_t recommendedMaxWorkingSetSize;
- (nullable id <MTLCommandQueue>)newCommandQueue;
- (nullable id <MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id <MTLBuffer>)newBufferWithBytes:(const void *)pointer length:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id <MTLBuffer>)newBufferWithBytesNoCopy:(void *)pointer length:(NSUInteger)length options:(MTLResourceOptions)options deallocator:(void (^ __nullable)(void *pointer, NSUInteger length))deallocator;
- (nullable id <MTLLibrary>)newLibraryWithSource:(NSString *)source options:(nullable MTLCompileOptions *)options error:(__autoreleasing NSError **)error;
- (nullable id <MTLComputePipelineState>)newComputePipelineStateWithFunction:(id <MTLFunction>)computeFunction error:(__autoreleasing NSError **)error;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
@property (readonly) NSUInteger maxBufferLength;
@end

NS_ASSUME_NONNULL_END
