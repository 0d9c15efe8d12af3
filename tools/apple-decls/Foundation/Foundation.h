// The project's declaration header for Foundation: only what csrc/backends/metal/device_metal.mm uses, with
// Apple's signatures, ownership and nullability (NSObjCRuntime.h, NSObject.h, NSString.h, NSError.h,
// NSArray.h, NSEnumerator.h, NSProcessInfo.h). scripts/check-objc compiles the .mm against it in CI, where
// Apple's SDK cannot be fetched, and compares every declaration here with the SDK's when the SDK is present.
#pragma once
#include <stddef.h>
#include <stdint.h>

// objc/objc.h and clang's Darwin keywords.
#define nil nullptr
#define __nullable _Nullable
#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type
#define NS_OPTIONS(_type, _name) _type _name; enum : _type
#define NS_RETURNS_RETAINED __attribute__((ns_returns_retained))
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))
#define API_AVAILABLE(...)
#define API_DEPRECATED(...)

typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef bool BOOL;
#define YES true
#define NO false

@class NSString;

// objc/NSObject.h: outside any assume-nonnull region, as Apple's is.
@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)new;
+ (instancetype)alloc;
- (instancetype)init;
@end

NS_ASSUME_NONNULL_BEGIN

@protocol NSCopying
@end

typedef struct {
  unsigned long state;
  id __unsafe_unretained _Nullable * _Nullable itemsPtr;
  unsigned long* _Nullable mutationsPtr;
  unsigned long extra[5];
} NSFastEnumerationState;

@protocol NSFastEnumeration
- (NSUInteger)countByEnumeratingWithState:(NSFastEnumerationState *)state objects:(id __unsafe_unretained _Nullable [_Nonnull])buffer count:(NSUInteger)len;
@end

@interface NSString : NSObject <NSCopying>
@end

@interface NSString (NSStringExtensionMethods)
@property (nullable, readonly) const char *UTF8String NS_RETURNS_INNER_POINTER;
+ (nullable instancetype)stringWithUTF8String:(const char *)nullTerminatedCString;
@end

@interface NSArray<__covariant ObjectType> : NSObject <NSCopying, NSFastEnumeration>
@property (readonly) NSUInteger count;
@end

@interface NSError : NSObject <NSCopying>
@property (readonly, copy) NSString *localizedDescription;
@end

typedef struct {
  NSInteger majorVersion;
  NSInteger minorVersion;
  NSInteger patchVersion;
} NSOperatingSystemVersion;

@interface NSProcessInfo : NSObject
@property (class, readonly, strong) NSProcessInfo *processInfo;
@property (readonly) NSOperatingSystemVersion operatingSystemVersion;
@property (readonly) unsigned long long physicalMemory;
- (BOOL) isOperatingSystemAtLeastVersion:(NSOperatingSystemVersion)version;
@end

NS_ASSUME_NONNULL_END
