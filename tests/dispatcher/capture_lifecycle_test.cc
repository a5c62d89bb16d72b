// The capture lifecycle's stages and its RAII capture window.
#include "dispatcher/capture_lifecycle.h"

#include <sstream>

#include "gtest/gtest.h"

namespace pdworker {
namespace {

TEST(CaptureLifecycleTest, StartsNotCaptured) {
  CaptureLifecycle lifecycle;
  EXPECT_EQ(lifecycle.stage(), CaptureStage::kNotCaptured);
  EXPECT_FALSE(lifecycle.CaptureAllowed());
}

TEST(CaptureLifecycleTest, WindowCapturesOnlyWhileOpen) {
  CaptureLifecycle lifecycle;
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle);
    EXPECT_EQ(lifecycle.stage(), CaptureStage::kCapturing);
    EXPECT_TRUE(lifecycle.CaptureAllowed());
  }
  // Closing does not claim the graphs are ready: the owner decides.
  EXPECT_EQ(lifecycle.stage(), CaptureStage::kNotCaptured);
  EXPECT_FALSE(lifecycle.CaptureAllowed());
}

TEST(CaptureLifecycleTest, ReadyAndDisabledOutliveTheWindow) {
  CaptureLifecycle lifecycle;
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle);
    lifecycle.MarkReady();
    EXPECT_FALSE(lifecycle.CaptureAllowed());
  }
  EXPECT_EQ(lifecycle.stage(), CaptureStage::kReady);
  {
    CaptureLifecycle::CaptureWindow capturing(lifecycle);
    lifecycle.Disable();
  }
  EXPECT_EQ(lifecycle.stage(), CaptureStage::kDisabled);
}

TEST(CaptureLifecycleTest, RecaptureFromAnyStage) {
  for (bool ready : {true, false}) {
    CaptureLifecycle lifecycle;
    if (ready) {
      lifecycle.MarkReady();
    } else {
      lifecycle.Disable();
    }
    {
      CaptureLifecycle::CaptureWindow capturing(lifecycle);
      EXPECT_TRUE(lifecycle.CaptureAllowed());
    }
    EXPECT_EQ(lifecycle.stage(), CaptureStage::kNotCaptured);
    lifecycle.MarkReady();
    EXPECT_EQ(lifecycle.stage(), CaptureStage::kReady);
  }
}

TEST(CaptureLifecycleTest, StableNames) {
  EXPECT_EQ(CaptureStageName(CaptureStage::kNotCaptured), "not_captured");
  EXPECT_EQ(CaptureStageName(CaptureStage::kCapturing), "capturing");
  EXPECT_EQ(CaptureStageName(CaptureStage::kReady), "ready");
  EXPECT_EQ(CaptureStageName(CaptureStage::kDisabled), "disabled");
  std::ostringstream os;
  os << CaptureStage::kReady;
  EXPECT_EQ(os.str(), "ready");
}

}  // namespace
}  // namespace pdworker
