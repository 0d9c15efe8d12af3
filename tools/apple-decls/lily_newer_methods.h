// Check-only: methods that protocols of the iPhoneOS 17.4 SDK gained later (macOS 15), with Apple's
// signatures. scripts/check-objc inserts each section at the end of the named protocol (in the SDK's headers
// or the project's Metal/Metal.h), so the .mm calls them on the real receiver types; not a header to include.
// forward
@protocol MTLResidencySet;
@class MTLResidencySetDescriptor;
// protocol MTLDevice
- (nullable id <MTLResidencySet>)newResidencySetWithDescriptor:(MTLResidencySetDescriptor *)desc error:(__autoreleasing NSError **)error API_AVAILABLE(macos(15.0));
// protocol MTLCommandQueue
- (void)addResidencySet:(id <MTLResidencySet>)residencySet API_AVAILABLE(macos(15.0));
- (void)removeResidencySet:(id <MTLResidencySet>)residencySet API_AVAILABLE(macos(15.0));
