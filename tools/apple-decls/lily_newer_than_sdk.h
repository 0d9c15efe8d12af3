// Check-only: Apple's declarations that csrc/backends/metal/device_metal.mm uses and the iPhoneOS 17.4 SDK
// (the newest whose headers can be fetched here) predates, with their signatures and values from Apple's
// documentation (developer.apple.com/documentation/metal). scripts/check-objc force-includes this after the
// SDK's headers (or after the project's declaration headers beside it), and inserts lily_newer_methods.h into
// the protocols those extend; a real Mac build never sees either (its SDK has them). Availability is macOS
// only: the check compiles for iOS 17, where an iOS 18 annotation would flag the .mm's macOS guards.
#pragma once
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

NS_ASSUME_NONNULL_BEGIN

// MTLLibrary.h, macOS 15 / iOS 18.
typedef NS_ENUM(NSInteger, MTLMathMode) {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
};

@interface MTLCompileOptions (LilyNewerThanSDK)
@property (readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
@end

// MTLAllocation.h, MTLResidencySet.h, macOS 15 / iOS 18. (There every MTLResource is an MTLAllocation; here
// device_metal.mm's casts of id<MTLBuffer> stand in for that conformance.)
API_AVAILABLE(macos(15.0))
@protocol MTLAllocation <NSObject>
@property (readonly) NSUInteger allocatedSize;
@end

API_AVAILABLE(macos(15.0))
@interface MTLResidencySetDescriptor : NSObject <NSCopying>
@property (copy, nonatomic, nullable) NSString* label;
@property (nonatomic) NSUInteger initialCapacity;
@end

API_AVAILABLE(macos(15.0))
@protocol MTLResidencySet <NSObject>
@property (readonly) id<MTLDevice> device;
@property (readonly, nullable) NSString* label;
@property (readonly) uint64_t allocatedSize;
- (void)requestResidency;
- (void)endResidency;
- (void)addAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllAllocations;
- (BOOL)containsAllocation:(id<MTLAllocation>)anAllocation;
@property (readonly) NSUInteger allocationCount;
- (void)commit;
@end

NS_ASSUME_NONNULL_END
